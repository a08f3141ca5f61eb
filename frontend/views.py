"""Console pages: each is a template shell; data comes from /api/v1 and live updates from /ws/v1/events/."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.csrf import ensure_csrf_cookie

from controlplane.accounts.selectors import user_role

PAGES = {"fleet", "worker", "storage", "operations", "launch", "operation", "audit"}


@login_required
@ensure_csrf_cookie
def page(request, name: str, pk: int | None = None):
    role = user_role(request.user)
    return render(
        request,
        f"frontend/{name}.html",
        {"page": name, "pk": pk, "role": role, "can_write": role in ("operator", "admin")},
    )
