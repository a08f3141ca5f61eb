from django.apps import AppConfig
from django.db.backends.signals import connection_created


class AuditConfig(AppConfig):
    name = "controlplane.audit"
    label = "audit"

    def ready(self):
        from controlplane.audit.append_only import register_sqlite_function

        connection_created.connect(register_sqlite_function, dispatch_uid="audit-append-only")
