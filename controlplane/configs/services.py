"""Writes for configs: profile creation and compare-and-set revision commits (never edits a revision)."""

import hashlib
import json

from django.db import transaction

from controlplane.audit.services import audit_record
from controlplane.configs.models import (
    CONFIG_FIELDS,
    NUMERIC_FIELDS,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    ConfigProfile,
    ConfigRevision,
)
from controlplane.core.exceptions import (
    ApplicationError,
    ConflictError,
    PreconditionFailed,
    PreconditionRequired,
)
from controlplane.core.serializers import unknown_key_errors
from controlplane.core.services import model_snapshot


def config_content_validate(content) -> dict:
    """Check a revision body; raises ApplicationError (400 ``bad_content``) naming the first bad field (an
    unknown key: each one in ``detail.content`` with the closest real field). Returns it unchanged."""
    if not isinstance(content, dict) or not content:
        raise ApplicationError("content must be a non-empty JSON object", code="bad_content")
    unknown = unknown_key_errors(content, CONFIG_FIELDS, what="config field")
    if unknown:
        first = sorted(unknown)[0]
        raise ApplicationError(
            f"{first!r}: {unknown[first][0]}",
            code="bad_content",
            detail={"content": dict(sorted(unknown.items()))},
        )
    checks = {
        "hicache_storage_prefetch_policy": lambda v: v in PREFETCH_POLICIES,
        "hicache_write_policy": lambda v: v in WRITE_POLICIES,
        "prefetch_threshold": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        **{
            f: (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0)
            for f in NUMERIC_FIELDS
        },
    }
    for field, value in content.items():
        if not checks[field](value):
            raise ApplicationError(
                f"invalid value {value!r} for {field}", code="bad_content", detail={"field": field}
            )
    return content


def _sha(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


@transaction.atomic
def profile_create(*, name: str, description: str = "", content: dict | None = None, actor) -> ConfigProfile:
    if ConfigProfile.objects.filter(name=name).exists():
        raise ConflictError(f"config profile {name!r} already exists", code="duplicate")
    profile = ConfigProfile(name=name, description=description)
    profile.full_clean()
    profile.save()
    if content is not None:
        config_content_validate(content)
        ConfigRevision.objects.create(
            profile=profile, number=1, content=content, content_sha256=_sha(content), created_by=_user(actor)
        )
        profile.head_number = 1
        profile.save(update_fields=["head_number"])
    audit_record(
        action="create", obj=profile, after={**model_snapshot(profile), "content": content}, actor=actor
    )
    return profile


def _user(actor):
    return actor if getattr(actor, "is_authenticated", False) else None


@transaction.atomic
def revision_commit(*, profile: ConfigProfile, if_match: str | None, content, message: str = "", actor):
    """Append revision head+1 if `if_match` equals the profile's current ETag (checked under a row lock).

    Raises PreconditionRequired (428) without If-Match, PreconditionFailed (412) if stale, ConflictError (409)
    when the content equals the head revision, ApplicationError (400) for a bad field.
    """
    if not if_match:
        raise PreconditionRequired(
            "If-Match header with the profile's ETag is required", detail={"etag": profile.etag}
        )
    locked = ConfigProfile.objects.select_for_update().get(pk=profile.pk)
    if if_match.removeprefix("W/") != locked.etag:
        raise PreconditionFailed(
            "the profile changed since you read it; reload and retry",
            detail={"etag": locked.etag, "head_number": locked.head_number},
        )
    config_content_validate(content)
    head = locked.revisions.filter(number=locked.head_number).first()
    if head is not None and head.content_sha256 == _sha(content):
        raise ConflictError("content is identical to the head revision", code="no_change")
    revision = ConfigRevision.objects.create(
        profile=locked,
        number=locked.head_number + 1,
        parent_number=locked.head_number or None,
        content=content,
        content_sha256=_sha(content),
        created_by=_user(actor),
        message=message,
    )
    locked.head_number = revision.number
    locked.save(update_fields=["head_number", "updated_at"])
    audit_record(
        action="commit",
        obj=revision,
        before=head.content if head else None,
        after=content,
        message=message,
        actor=actor,
        extra={"profile_id": locked.pk, "revision_id": revision.pk, "number": revision.number},
    )
    profile.head_number = locked.head_number
    return revision
