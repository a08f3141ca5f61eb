"""Pagination: limit/offset for inventory lists (default 50, max 500); a cursor for append-only logs."""

from rest_framework import pagination


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    default_limit = 50
    max_limit = 500


class CursorPagination(pagination.CursorPagination):
    """Stable under inserts and without COUNT: used by the audit log (newest first)."""

    page_size = 50
    max_page_size = 500
    page_size_query_param = "limit"
    ordering = ("-occurred_at", "-id")
