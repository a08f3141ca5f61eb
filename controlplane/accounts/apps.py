from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"

    def ready(self):
        from controlplane.accounts import signals  # noqa: F401 (registers the receivers)
