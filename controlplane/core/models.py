"""Abstract bases shared by the apps' models (no table of their own)."""

from django.db import models


class TimeStamped(models.Model):
    """`created_at` set once on insert, `updated_at` on every save() (a queryset update() sets it only when
    the caller passes it, as the state machine's compare-and-set does)."""

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True
