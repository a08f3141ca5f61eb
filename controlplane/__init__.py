"""KVFleet control plane (Django project). Importing the Celery app binds @shared_task at startup."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
