"""ServiceModelViewSet: a DRF ModelViewSet whose writes go through services (one audit record each)."""

from rest_framework import viewsets

from controlplane.core.services import model_create, model_delete, model_update


class ServiceModelViewSet(viewsets.ModelViewSet):
    """Subclasses may override create_service/update_service/delete_service with app services."""

    def create_service(self, *, data: dict, actor):
        return model_create(model=self.queryset.model, data=data, actor=actor)

    def update_service(self, *, instance, data: dict, actor):
        return model_update(instance=instance, data=data, actor=actor)

    def delete_service(self, *, instance, actor) -> None:
        model_delete(instance=instance, actor=actor)

    def perform_create(self, serializer):
        serializer.instance = self.create_service(data=serializer.validated_data, actor=self.request.user)

    def perform_update(self, serializer):
        serializer.instance = self.update_service(
            instance=serializer.instance, data=serializer.validated_data, actor=self.request.user
        )

    def perform_destroy(self, instance):
        self.delete_service(instance=instance, actor=self.request.user)
