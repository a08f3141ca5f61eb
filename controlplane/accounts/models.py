"""ApiToken: `cp_<prefix>.<secret>`; only an HMAC-SHA256 digest of the secret is stored (NetBox v2 tokens)."""

from django.conf import settings
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    """Roles are Django groups of the same name (seeded by migration 0002).

    viewer reads everything and changes nothing; operator manages inventory/configs and runs operations; admin
    also manages users and tokens; agent only calls the agent endpoints (register, heartbeat, metrics ingest).
    """

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    AGENT = "agent"


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    write_enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    host_name = models.CharField(
        max_length=100,
        blank=True,
        help_text="Agent tokens: the one host (inventory host name) whose register, heartbeat and metrics "
        "calls this token may make; set at issue",
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} (cp_{self.prefix})"

    @property
    def is_active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    def audit_snapshot(self) -> dict:
        return {
            "name": self.name,
            "prefix": self.prefix,
            "user": self.user.get_username(),
            "write_enabled": self.write_enabled,
            "host": self.host_name,
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }
