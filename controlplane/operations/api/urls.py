from rest_framework.routers import SimpleRouter

from controlplane.operations.api import views

router = SimpleRouter()
router.register("", views.OperationViewSet, basename="operation")
urlpatterns = router.urls
