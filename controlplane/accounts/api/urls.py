from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.accounts.api import views

router = SimpleRouter()
router.register("users", views.UserViewSet, basename="user")
router.register("tokens", views.ApiTokenViewSet, basename="apitoken")
urlpatterns = [path("me/", views.MeApi.as_view(), name="me"), *router.urls]
