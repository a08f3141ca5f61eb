"""Strict request bodies for the whole API: every serializer in ``controlplane/*/api/`` derives from
:class:`StrictSerializer` or :class:`StrictModelSerializer`.

On a write (a JSON object body, or a nested object such as a rebalance's ``slo``) they refuse, as a 400
``validation_error`` whose ``detail`` names each offending key:

- a key the serializer does not know: ``{"max_ttft": ["unknown field; did you mean 'max_ttft_s'?"]}`` (the
  closest real field by :func:`difflib.get_close_matches`, else the list of fields);
- a read-only field: ``{"cpu_count": ["read-only field; it cannot be written"]}``;
- a boolean that is not JSON ``true``/``false`` (DRF would take ``"yes"``, ``"1"``, ``1``):
  ``{"drain": ["must be a JSON boolean (true or false), got 'yes'"]}``. Query strings and form posts carry
  only text, so there ``true``/``false`` (DRF's spellings) stay accepted.

Nothing is written when the body is refused: validation runs before any service call.
"""

import difflib
from collections.abc import Iterable, Mapping

from django.http import QueryDict
from rest_framework import serializers

# Form posts (the browsable API) carry these besides the fields.
FORM_KEYS = frozenset({"csrfmiddlewaretoken"})


def closest_hint(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for the closest of ``known`` to ``name``, else ``"known: a, b, c"``."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known: {', '.join(known)}" if known else "none are accepted"


def unknown_key_errors(data: Mapping, known: Iterable[str], what: str = "field") -> dict[str, list[str]]:
    """``{key: ["unknown <what>; did you mean ...?"]}`` for each key of ``data`` not in ``known``."""
    known = set(known)
    return {key: [f"unknown {what}; {closest_hint(key, known)}"] for key in data if key not in known}


class StrictMixin:
    """Refuses unknown keys, read-only fields and non-JSON booleans in the body (see the module doc)."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            errors = self.strict_errors(data)
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)

    def strict_errors(self, data: Mapping) -> dict[str, list[str]]:
        fields = self.fields
        writable = {name for name, field in fields.items() if not field.read_only}
        read_only = {name for name, field in fields.items() if field.read_only}
        is_form = isinstance(data, QueryDict)
        errors: dict[str, list[str]] = {}
        for key in data:
            if key in read_only:
                errors[key] = ["read-only field; it cannot be written"]
            elif key not in writable and not (is_form and key in FORM_KEYS):
                errors[key] = [f"unknown field; {closest_hint(key, writable)}"]
            elif not is_form and isinstance(fields[key], serializers.BooleanField):
                value = data[key]
                if not isinstance(value, bool) and not (value is None and fields[key].allow_null):
                    errors[key] = [f"must be a JSON boolean (true or false), got {value!r}"]
        return errors


class StrictSerializer(StrictMixin, serializers.Serializer):
    pass


class StrictModelSerializer(StrictMixin, serializers.ModelSerializer):
    pass
