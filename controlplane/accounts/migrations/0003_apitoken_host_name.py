"""Agent tokens are bound to one host. Existing agent tokens are bound to the host they last registered
(read from the audit log); an agent token that never registered stays unbound and the agent API refuses it
(issue a new one with ``host``)."""

from django.db import migrations, models


def bind_existing_agent_tokens(apps, schema_editor):
    ApiToken = apps.get_model("accounts", "ApiToken")
    AuditEvent = apps.get_model("audit", "AuditEvent")
    for token in ApiToken.objects.filter(user__groups__name="agent", host_name=""):
        last = (
            AuditEvent.objects.filter(
                action="register", object_type="inventory.host", token_prefix=token.prefix
            )
            .order_by("-occurred_at", "-id")
            .first()
        )
        if last is not None:
            ApiToken.objects.filter(pk=token.pk).update(host_name=last.object_repr[:100])


class Migration(migrations.Migration):
    dependencies = [("accounts", "0002_role_groups"), ("audit", "0001_initial")]
    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="host_name",
            field=models.CharField(
                blank=True,
                help_text="Agent tokens: the one host (inventory host name) whose register, heartbeat and "
                "metrics calls this token may make; set at issue",
                max_length=100,
            ),
        ),
        migrations.RunPython(bind_existing_agent_tokens, migrations.RunPython.noop),
    ]
