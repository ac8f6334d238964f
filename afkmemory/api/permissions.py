"""Permissions of the REST API: an authenticated account, touching only what it owns."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request


class IsOwner(BasePermission):
    """The object (a thread, a memory) belongs to the requesting account.

    Every queryset is already scoped to the account, so another tenant's object is a 404
    before this runs (DRF checks no object permission on lists and creates); this is the
    second lock on the same door.
    """

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        owner_id = getattr(obj, "owner_id", None)
        return owner_id is not None and owner_id == request.user.pk
