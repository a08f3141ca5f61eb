"""Generic audited create/update/delete used by the per-app services (HackSoft `model_update` style).

Each call validates with full_clean(), writes inside one transaction and appends exactly one audit record with
the before/after snapshot. Fields listed in a model's `audit_masked_fields` are recorded as "***".
"""

from datetime import date, datetime
from decimal import Decimal

from django.db import IntegrityError, models, transaction
from django.db.models import ProtectedError

from controlplane.audit.services import audit_record
from controlplane.core.exceptions import ConflictError


def model_snapshot(instance: models.Model) -> dict:
    """The audited fields of `instance`: `audit_masked_fields` as "***" (or "" when empty),
    `audit_counted_fields` (large tables kept elsewhere) as their number of entries."""
    masked = set(getattr(instance, "audit_masked_fields", ()))
    counted = set(getattr(instance, "audit_counted_fields", ()))
    out = {}
    for field in instance._meta.concrete_fields:
        value = getattr(instance, field.attname)
        if field.name in masked:
            value = "***" if value else ""
        elif field.name in counted:
            value = f"{len(value or ())} entries"
        elif isinstance(value, datetime | date):
            value = value.isoformat()
        elif isinstance(value, Decimal):
            value = str(value)
        out[field.attname] = value
    return out


def model_create(*, model: type[models.Model], data: dict, actor, message: str = "") -> models.Model:
    with transaction.atomic():
        instance = model(**data)
        instance.full_clean()
        try:
            instance.save()
        except IntegrityError as exc:
            raise ConflictError(f"{model._meta.verbose_name} conflicts with an existing one: {exc}") from exc
        audit_record(
            action="create", obj=instance, after=model_snapshot(instance), actor=actor, message=message
        )
    return instance


def _stored_values(instance: models.Model) -> dict:
    return {field.attname: getattr(instance, field.attname) for field in instance._meta.concrete_fields}


def model_update(*, instance: models.Model, data: dict, actor, message: str = "") -> models.Model:
    """Sets ``data`` on ``instance``, validates and saves it with one ``update`` audit record; a ``data``
    that changes no stored value (an empty PATCH, or the current values again) saves nothing and writes
    no audit record."""
    with transaction.atomic():
        before = model_snapshot(instance)
        unchanged = _stored_values(instance)
        for key, value in data.items():
            setattr(instance, key, value)
        instance.full_clean()
        if _stored_values(instance) == unchanged:
            return instance
        instance.save()
        audit_record(
            action="update",
            obj=instance,
            before=before,
            after=model_snapshot(instance),
            actor=actor,
            message=message,
        )
    return instance


def model_delete(*, instance: models.Model, actor, message: str = "") -> None:
    with transaction.atomic():
        before = model_snapshot(instance)
        record = {
            "object_type": instance._meta.label_lower,
            "object_id": str(instance.pk),
            "object_repr": str(instance),
        }
        try:
            instance.delete()
        except ProtectedError as exc:
            raise ConflictError(f"{instance} is still referenced and cannot be deleted") from exc
        audit_record(action="delete", before=before, actor=actor, message=message, **record)
