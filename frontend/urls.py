from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import path
from django.views.generic import RedirectView

from frontend import views

app_name = "console"
urlpatterns = [
    path("favicon.ico", RedirectView.as_view(url=static("frontend/favicon.svg"), permanent=True)),
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="frontend/login.html", redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.fleet, name="fleet"),
    path("workers/<int:pk>/", views.worker, name="worker"),
    path("hosts/<int:pk>/", views.host, name="host"),
    path("routers/<int:pk>/", views.router, name="router"),
    path("routers/<int:pk>/rebalance/", views.rebalance, name="rebalance"),
    path("storage/", views.storage, name="storage"),
    path("capacity/", views.capacity, name="capacity"),
    path("operations/", views.page, {"name": "operations"}, name="operations"),
    path("operations/new/", views.page, {"name": "launch"}, name="launch"),
    path("operations/<int:pk>/", views.page, {"name": "operation"}, name="operation"),
    path("audit/", views.page, {"name": "audit"}, name="audit"),
]
