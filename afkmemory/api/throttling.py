"""Per-account request throttling, counted in Django's default cache (Redis in production)."""

from __future__ import annotations

from rest_framework.settings import api_settings
from rest_framework.throttling import UserRateThrottle


class AccountRateThrottle(UserRateThrottle):
    """Requests per account, at ``DEFAULT_THROTTLE_RATES["afkmemory"]``.

    The rate is read on each request, so ``override_settings`` applies, and an absent rate
    means no limit. DRF's throttles use non-atomic cache operations: they shed load; they
    are not a security boundary (two requests at once can both pass a full bucket). A
    request without valid credentials is refused (401) before any throttle runs, so it is
    not counted: limit those per client address at the proxy in front (README, "Limits").
    """

    scope = "afkmemory"

    def get_rate(self) -> str | None:
        rate = api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)
        return None if rate is None else str(rate)
