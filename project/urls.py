"""URL configuration of the example project."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("afkmemory.api.urls")),
    path("api-auth/", include("rest_framework.urls")),  # log in and out of the browsable API
]
