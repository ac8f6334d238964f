"""What the debug page and the error reports leave out of the settings they show."""

import re

from django.views.debug import SafeExceptionReporterFilter


class SettingsFilter(SafeExceptionReporterFilter):
    """Hide URLs too: REDIS_URL, the cache's LOCATION and CELERY_BROKER_URL carry Redis's password."""

    hidden_settings = re.compile(f"{SafeExceptionReporterFilter.hidden_settings.pattern}|URL|LOCATION|BROKER", re.I)
