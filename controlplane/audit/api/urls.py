from rest_framework.routers import SimpleRouter

from controlplane.audit.api import views

router = SimpleRouter()
router.register("events", views.AuditEventViewSet, basename="auditevent")
urlpatterns = router.urls
