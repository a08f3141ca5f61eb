from django.apps import AppConfig


class RebalanceConfig(AppConfig):
    name = "controlplane.rebalance"
    label = "rebalance"
