from rest_framework.routers import SimpleRouter

from controlplane.rebalance.api import views

router = SimpleRouter()
router.register("", views.RebalanceViewSet, basename="rebalance")
urlpatterns = router.urls
