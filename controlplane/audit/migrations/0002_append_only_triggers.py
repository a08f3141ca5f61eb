"""Audit rows append-only in the database: triggers on PostgreSQL and SQLite (see audit/append_only.py).

The actor foreign key no longer nulls itself when a user is deleted (that UPDATE would be refused): the row
keeps the actor's id and name (`actor_display`) as they were.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models
from django.db.utils import NotSupportedError

COLUMNS = (
    "id",
    "occurred_at",
    "actor_id",
    "actor_display",
    "actor_type",
    "token_prefix",
    "request_id",
    "source_ip",
    "action",
    "object_type",
    "object_id",
    "object_repr",
    "operation_id",
    "before",
    "after",
    "changes",
    "message",
    "extra",
)  # every column but `outcome`

POSTGRES_UP = """
CREATE OR REPLACE FUNCTION audit_auditevent_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.outcome = 'pending' AND NEW.outcome <> 'pending'
       AND (to_jsonb(NEW) - 'outcome') = (to_jsonb(OLD) - 'outcome') THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit events are append-only (% refused)', TG_OP;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER audit_auditevent_append_only BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_auditevent_append_only();
"""
POSTGRES_DOWN = """
DROP TRIGGER IF EXISTS audit_auditevent_append_only ON audit_auditevent;
DROP FUNCTION IF EXISTS audit_auditevent_append_only();
"""
_SAME = " AND ".join(f'NEW."{c}" IS OLD."{c}"' for c in COLUMNS)
SQLITE_UP = [
    "CREATE TRIGGER audit_auditevent_no_delete BEFORE DELETE ON audit_auditevent "
    "WHEN NOT kvfleet_audit_purge_allowed() "
    "BEGIN SELECT RAISE(ABORT, 'audit events are append-only (DELETE refused)'); END;",
    "CREATE TRIGGER audit_auditevent_no_update BEFORE UPDATE ON audit_auditevent "
    f"WHEN NOT (OLD.outcome = 'pending' AND NEW.outcome <> 'pending' AND {_SAME}) "
    "BEGIN SELECT RAISE(ABORT, 'audit events are append-only (UPDATE refused)'); END;",
]
SQLITE_DOWN = [
    "DROP TRIGGER IF EXISTS audit_auditevent_no_delete;",
    "DROP TRIGGER IF EXISTS audit_auditevent_no_update;",
]


def _run(schema_editor, statements) -> None:
    for sql in statements:
        schema_editor.execute(sql, params=None)


def install(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        _run(schema_editor, [POSTGRES_UP])
    elif vendor == "sqlite":
        _run(schema_editor, SQLITE_UP)
    else:
        # KVFleet supports SQLite and PostgreSQL only; on another database the audit log could not be
        # append-only, so the migration refuses to run rather than leave it writable.
        raise NotSupportedError(f"audit append-only triggers exist for SQLite and PostgreSQL, not {vendor}")


def uninstall(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    _run(schema_editor, [POSTGRES_DOWN] if vendor == "postgresql" else SQLITE_DOWN)


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="actor",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.RunPython(install, uninstall),
    ]
