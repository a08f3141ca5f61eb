"""Pagination: limit/offset for inventory lists (default 50, max 500); a cursor for append-only logs.

A ``limit`` or ``offset`` that is not a whole number in range is a 400 ``validation_error`` naming the
parameter (DRF would silently fall back to the default page); so is a ``cursor`` that is not one a page's
``next``/``previous`` link gave (DRF answers 404 "Invalid cursor").
"""

from rest_framework import pagination
from rest_framework.exceptions import NotFound, ValidationError


def _int_param(request, name: str, minimum: int) -> int | None:
    """``?name=`` as an int >= ``minimum``; None when absent; ValidationError (400) when malformed."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValidationError({name: [f"must be an integer >= {minimum}, got {raw!r}"]})
    return value


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    default_limit = 50
    max_limit = 500

    def get_limit(self, request):
        limit = _int_param(request, self.limit_query_param, 1)
        return self.default_limit if limit is None else min(limit, self.max_limit)

    def get_offset(self, request):
        return _int_param(request, self.offset_query_param, 0) or 0


class CursorPagination(pagination.CursorPagination):
    """Stable under inserts and without COUNT: used by the audit log (newest first)."""

    page_size = 50
    max_page_size = 500
    page_size_query_param = "limit"
    ordering = ("-occurred_at", "-id")

    def get_page_size(self, request):
        limit = _int_param(request, self.page_size_query_param, 1)
        return self.page_size if limit is None else min(limit, self.max_page_size)

    def decode_cursor(self, request):
        try:
            return super().decode_cursor(request)
        except NotFound:
            raise ValidationError(
                {self.cursor_query_param: ["not a cursor this list gave; follow its next or previous link"]}
            ) from None
