"""App configuration for afkmemory."""

from django.apps import AppConfig
from django.conf import settings
from django.core.signals import setting_changed
from django.db.models.signals import pre_delete


class AfkMemoryConfig(AppConfig):
    name = "afkmemory"
    verbose_name = "Agent memory"
    # Pinned so the app's migrations never depend on the host project's DEFAULT_AUTO_FIELD.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .conf import reload_settings
        from .receivers import delete_owned_threads

        setting_changed.connect(reload_settings, dispatch_uid="afkmemory.conf.reload_settings")
        # The rows' owner is AUTH_USER_MODEL: an account's delete takes its threads as a thread's delete does.
        pre_delete.connect(
            delete_owned_threads, sender=settings.AUTH_USER_MODEL, dispatch_uid="afkmemory.delete_owned_threads"
        )
