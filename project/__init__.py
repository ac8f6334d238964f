"""Example deployment of afkmemory: settings, URLs and the WSGI/ASGI entry points."""
