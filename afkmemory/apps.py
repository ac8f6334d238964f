"""App configuration for afkmemory."""

from django.apps import AppConfig
from django.core.signals import setting_changed


class AfkMemoryConfig(AppConfig):
    name = "afkmemory"
    verbose_name = "Agent memory"
    # Pinned so the app's migrations never depend on the host project's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .conf import reload_settings

        setting_changed.connect(reload_settings, dispatch_uid="afkmemory.conf.reload_settings")
