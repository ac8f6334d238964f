"""Example deployment of afkmemory: settings, URLs, Celery and the WSGI/ASGI entry points."""

from .celery import app as celery_app

__all__ = ["celery_app"]
