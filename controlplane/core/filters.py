"""``?ordering=``: DRF's OrderingFilter, but an unknown field is a 400 ``validation_error`` naming the
parameter and the allowed fields (DRF silently drops it and keeps the default order)."""

from rest_framework import filters
from rest_framework.exceptions import ValidationError


class OrderingFilter(filters.OrderingFilter):
    def get_ordering(self, request, queryset, view):
        raw = request.query_params.get(self.ordering_param)
        if raw is not None:
            allowed = sorted(name for name, _ in self.get_valid_fields(queryset, view, {"request": request}))
            wanted = [term.strip() for term in raw.split(",") if term.strip()]
            bad = [term for term in wanted if term.lstrip("-") not in allowed]
            if bad or not wanted:
                raise ValidationError(
                    {
                        self.ordering_param: [
                            f"unknown field {(bad or [raw])[0]!r}; use one of {', '.join(allowed)}"
                        ]
                    }
                )
        return super().get_ordering(request, queryset, view)
