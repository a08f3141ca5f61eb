"""List query parameters.

``?ordering=``: DRF's OrderingFilter, but an unknown field is a 400 ``validation_error`` naming the
parameter and the allowed fields (DRF silently drops it and keeps the default order).

:class:`KnownQueryParamsFilter`: a query parameter that is none of the view's filters, its ``ordering``,
its paginator's parameters or ``format`` is a 400 ``validation_error`` naming it and the closest real one
(django-filter ignores unknown parameters and returns the list unfiltered)."""

from django_filters.rest_framework import DjangoFilterBackend
from rest_framework import filters
from rest_framework.exceptions import ValidationError
from rest_framework.settings import api_settings

from controlplane.core.serializers import unknown_key_errors

PAGINATOR_PARAMS = ("limit_query_param", "offset_query_param", "cursor_query_param", "page_size_query_param")


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


def known_query_params(request, queryset, view) -> set[str]:
    """The query parameters ``view`` reads: its filterset's filters, ``ordering``, its paginator's
    parameters, ``format`` and any ``extra_query_params`` it lists."""
    known = {api_settings.URL_FORMAT_OVERRIDE, *getattr(view, "extra_query_params", ())}
    filterset_class = DjangoFilterBackend().get_filterset_class(view, queryset)
    if filterset_class is not None:
        known.update(filterset_class.base_filters)
    known.add(OrderingFilter.ordering_param)
    paginator = getattr(view, "paginator", None)
    known.update(getattr(paginator, attr) for attr in PAGINATOR_PARAMS if getattr(paginator, attr, None))
    return known


class KnownQueryParamsFilter(filters.BaseFilterBackend):
    """Refuses query parameters the view does not read (see the module doc); filters nothing itself."""

    def filter_queryset(self, request, queryset, view):
        errors = unknown_key_errors(
            request.query_params, known_query_params(request, queryset, view), what="query parameter"
        )
        if errors:
            raise ValidationError(errors)
        return queryset
