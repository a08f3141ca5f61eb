from rest_framework.routers import SimpleRouter

from controlplane.configs.api import views

router = SimpleRouter()
router.register("profiles", views.ConfigProfileViewSet, basename="configprofile")
urlpatterns = router.urls
