from django.urls import path

from controlplane.capacity.api import views

urlpatterns = [
    path("sizing/", views.SizingApi.as_view(), name="capacity-sizing"),
    path("workers/", views.WorkerCapacitiesApi.as_view(), name="capacity-workers"),
]
