"""URLs of the benchmark: the example project's, plus a DRF endpoint that does no work.

The bare endpoint runs the same middleware, authentication and permission classes as
the API (the project's ``REST_FRAMEWORK`` defaults) and returns a constant: it is the
framework's floor the REST workload compares afkmemory's endpoints with.
"""

from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from project.urls import urlpatterns as project_urlpatterns


class BareView(APIView):
    """Answer GET and POST with a constant, touching nothing but the framework."""

    def get(self, request, *args, **kwargs):
        return Response({"value": 1})

    def post(self, request, *args, **kwargs):
        request.data  # parse the body, as a real create would  # noqa: B018
        return Response({"ok": True}, status=201)


urlpatterns = [
    *project_urlpatterns,
    path("bench/bare/", BareView.as_view(), name="bench-bare"),
]
