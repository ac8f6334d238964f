"""afkmemory's REST API: Django REST framework views over the stores, scoped to the requesting account."""
