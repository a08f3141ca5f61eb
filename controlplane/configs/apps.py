from django.apps import AppConfig


class ConfigsConfig(AppConfig):
    name = "controlplane.configs"
    label = "configs"
