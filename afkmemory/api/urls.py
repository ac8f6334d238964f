"""URLs of the REST API (include them under a version prefix such as ``api/v1/``)."""

from __future__ import annotations

from typing import Any

from django.urls import path, re_path
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.routers import APIRootView, DefaultRouter, Route
from rest_framework.views import APIView

from . import views
from .exceptions import exception_handler
from .schema import API_VERSION, SPECTACULAR
from .throttling import AccountRateThrottle

app_name = "afkmemory_api"


class PageView(APIView):
    """What the API's pages that are not viewsets (its root, schema and docs) share with ``views.ApiView``:
    accounts only, the API's throttle and error handling, OPTIONS answered 405, and errors in JSON."""

    permission_classes = [IsAuthenticated]
    throttle_classes = [AccountRateThrottle]
    http_method_names = views.ApiView.http_method_names

    def get_exception_handler(self) -> Any:
        return exception_handler

    def handle_exception(self, exc: Exception) -> Response:
        # Not in the page's own format: the docs page's HTML template read request.user again
        # for its context, and a bad token's 401 was a 500; the schema's was YAML.
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), "application/json"
        return super().handle_exception(exc)


@extend_schema(exclude=True)
class SchemaView(PageView, SpectacularAPIView):
    """The OpenAPI 3 schema of this API (itself left out of it), counted by the API's throttle."""

    custom_settings = SPECTACULAR
    # The schema's version, not the caller's ?version=, which drf-spectacular writes into
    # the Content-Disposition header unchecked (a line break in it was a 500).
    api_version = API_VERSION


class DocsView(PageView, SpectacularSwaggerView):
    """Swagger UI over the schema, for a logged-in browser session."""

    url_name = "afkmemory_api:schema"
    title = str(SPECTACULAR["TITLE"])


class RootView(PageView, APIRootView):
    """The list of the API's endpoints, for accounts only (DRF's default lets anyone in)."""

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        return views.own_transactions(super().as_view(**initkwargs))


class Router(DefaultRouter):
    """DRF's router, whose list routes also answer DELETE on a viewset with a ``forget`` method.

    ``DELETE memories/?user_id=`` deletes a user's memories: the collection, narrowed by its
    query, rather than a path such as ``memories/forget/``, which a memory's id can name.
    """

    routes = [
        route._replace(mapping={**route.mapping, "delete": "forget"})
        if isinstance(route, Route) and not route.detail
        else route
        for route in DefaultRouter.routes
    ]


router = Router()
router.APIRootView = RootView
router.include_format_suffixes = False  # ids may contain dots: threads/a.json/ is thread "a.json"
router.register("threads", views.ThreadViewSet, basename="thread")
router.register(r"threads/(?P<thread_id>[^/]+)/events", views.EventViewSet, basename="thread-events")
router.register(r"threads/(?P<thread_id>[^/]+)/state", views.StateViewSet, basename="thread-state")
router.register(r"threads/(?P<thread_id>[^/]+)/checkpoints", views.CheckpointViewSet, basename="thread-checkpoints")
router.register("memories", views.MemoryViewSet, basename="memory")

urlpatterns = [
    # A state key is the rest of the path, with no trailing slash: keys may contain '/' (as %2F or not).
    re_path(
        r"^threads/(?P<thread_id>[^/]+)/state/(?P<key>[\s\S]+)$",
        views.StateKeyViewSet.as_view({"get": "retrieve", "put": "update", "delete": "destroy"}),
        name="thread-state-key",
    ),
    path(
        "store/items/",
        views.StoreItemViewSet.as_view({"get": "retrieve", "put": "save", "delete": "destroy"}),
        name="store-items",
    ),
    path("store/items/search/", views.StoreItemViewSet.as_view({"post": "search"}), name="store-items-search"),
    path("store/namespaces/", views.NamespaceViewSet.as_view({"post": "list"}), name="store-namespaces"),
    path("schema/", views.own_transactions(SchemaView.as_view()), name="schema"),
    path("schema/docs/", views.own_transactions(DocsView.as_view()), name="schema-docs"),
    *router.urls,
    # Anything else under the API is a JSON 404, like every other API error (not Django's HTML page).
    re_path(r"^[\s\S]*$", views.not_found, name="not-found"),
]
