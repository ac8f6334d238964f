"""Settings for the example project; everything deployment-specific comes from the environment."""

import os
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("AFKMEMORY_VAR_DIR", BASE_DIR / "var"))


def env_flag(name: str, default: bool) -> bool:
    """Return an on/off variable; refuse a value that is neither, rather than read it as off."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={os.environ[name]!r}: use 1, true, yes or on, or 0, false, no or off.")


def env_list(name: str, default: str) -> list[str]:
    """Return a comma-separated variable's items, without the spaces around them or empty ones."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_whole(name: str, default: int, *, minimum: int = 0, unit: str = "seconds") -> int:
    """Return a whole number of ``unit``, ``minimum`` or more (``default`` if unset or empty); refuse anything else.

    An empty variable (``NAME=`` in a compose or .env file) is unset, not a traceback.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()) or int(value) < minimum:
        raise ImproperlyConfigured(f"{name}={os.environ[name]!r}: give a whole number of {unit}, {minimum} or more.")
    return int(value)


def conn_max_age() -> int | None:
    """``CONN_MAX_AGE``: seconds, or ``none`` for connections kept as long as they work (Django's None)."""
    if os.environ.get("CONN_MAX_AGE", "").strip().lower() == "none":
        return None
    return env_whole("CONN_MAX_AGE", 60)


DEBUG = env_flag("DJANGO_DEBUG", default=True)
# The development key is in the repository: with it, whatever Django signs (password-reset
# tokens, signed cookies, the messages cookie) could be forged, so a deployment must set its own.
DEVELOPMENT_KEY = "dev-only-insecure-key-change-me"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or (DEVELOPMENT_KEY if DEBUG else "")
if not DEBUG and SECRET_KEY.strip() in ("", DEVELOPMENT_KEY):
    raise ImproperlyConfigured(
        "Set DJANGO_SECRET_KEY to a key of your own when DJANGO_DEBUG=0: the development key is published with "
        'the code. One: python -c "from django.core.management.utils import get_random_secret_key as k; print(k())"'
    )
# Rotating the key: the old one here keeps what it signed valid meanwhile (sessions, the API's cursors).
SECRET_KEY_FALLBACKS = env_list("DJANGO_SECRET_KEY_FALLBACKS", "")
if not DEBUG and DEVELOPMENT_KEY in SECRET_KEY_FALLBACKS:
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY_FALLBACKS holds the development key, published with the code: what it signs is forgeable."
    )
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost")
# Served over HTTPS by a proxy in front (which sets X-Forwarded-Proto, and replaces any a client
# sent): cookies only over HTTPS, plain HTTP redirected, and HSTS for DJANGO_HSTS_SECONDS (0:
# none; start small, browsers remember it). Off, as `make run` serves plain HTTP.
HTTPS = env_flag("DJANGO_HTTPS", default=False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = HTTPS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if HTTPS else None
SECURE_HSTS_SECONDS = env_whole("DJANGO_HSTS_SECONDS", 0) if HTTPS else 0
# REDIS_URL may hold a password, and it is in CACHES and CELERY_BROKER_URL too, whose names
# Django's filter does not hide from the debug page and the error reports: this one does.
DEFAULT_EXCEPTION_REPORTER_FILTER = "project.debug.SettingsFilter"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served with the static files
    "afkmemory",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"


def sqlite_database(path: Path) -> dict[str, Any]:
    """Return an SQLite database entry tuned for several writer processes."""
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        "OPTIONS": {
            # Take the write lock when a transaction starts, so two writers never
            # deadlock upgrading read locks; wait for it instead of failing at once.
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
    }


def database_from_url(url: str) -> dict[str, Any]:
    """Return a database entry for DATABASE_URL (a percent-encoded host is a socket dir)."""
    config: dict[str, Any] = dict(dj_database_url.parse(url, conn_max_age=conn_max_age()))
    config["CONN_HEALTH_CHECKS"] = True
    if config["ENGINE"] == "django.db.backends.sqlite3":
        return sqlite_database(Path(config["NAME"]))
    return config


DATABASES = {
    "default": database_from_url(os.environ["DATABASE_URL"])
    if os.environ.get("DATABASE_URL")
    else sqlite_database(VAR_DIR / "afkmemory.sqlite3")
}

REDIS_URL = os.environ.get("REDIS_URL", "")
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        # Fail open: while Redis is down, the throttle (the cache's only user) counts nothing
        # and the API serves, rather than answering every request 500; each failure is logged.
        # The timeouts keep an unreachable Redis from holding each request for minutes.
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            "IGNORE_EXCEPTIONS": True,
            "SOCKET_CONNECT_TIMEOUT": 2,
            "SOCKET_TIMEOUT": 2,
        },
    }
    if REDIS_URL
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}
DJANGO_REDIS_LOG_IGNORED_EXCEPTIONS = True

# Celery: Redis when REDIS_URL is set, else a broker that needs no server (kombu's
# filesystem transport under var/broker). Beat runs the scheduled jobs; they are
# single-flight, so a second beat or a cron line beside it does no harm.
CELERY_BROKER_URL = REDIS_URL or "filesystem://"
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = (
    {"visibility_timeout": 3600}
    if REDIS_URL
    else {
        "data_folder_in": str(VAR_DIR / "broker" / "out"),
        "data_folder_out": str(VAR_DIR / "broker" / "out"),
        "processed_folder": str(VAR_DIR / "broker" / "processed"),
        "control_folder": str(VAR_DIR / "broker" / "control"),
        "store_processed": False,
    }
)
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "afkmemory-sweep-store": {
        "task": "afkmemory.sweep_store",
        "schedule": env_whole("AFKMEMORY_SWEEP_EVERY", 300, minimum=1),
    },
    "afkmemory-compact-threads": {
        "task": "afkmemory.compact_threads",
        "schedule": env_whole("AFKMEMORY_COMPACT_EVERY", 3600, minimum=1),
    },
}

# The REST API (afkmemory.api at /api/v1/): token auth for agents, sessions for the
# browsable API and the docs page; nothing without an account. Throttling counts in the
# default cache (Redis when REDIS_URL is set, so every process shares the counts).
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",  # first: anonymous requests get 401
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["afkmemory.api.parsers.BoundedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_THROTTLE_CLASSES": ["afkmemory.api.throttling.AccountRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"afkmemory": os.environ.get("AFKMEMORY_API_RATE", "1200/minute")},
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "afkmemory.api.exceptions.exception_handler",
}
# One name for afkmemory's event types in the project's schema (drf-spectacular's check).
SPECTACULAR_SETTINGS = {
    "ENUM_NAME_OVERRIDES": {"EventTypeEnum": "afkmemory.api.schema.EVENT_TYPE_ENUM"},
    # The docs page loads Swagger UI from this server, pinned by the requirements: drf-spectacular's
    # default is the newest release from a CDN, run unchecked in the admin's origin and session.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}
# Largest request body; the API answers 413 above it (and AFKMEMORY["API_MAX_VALUE_BYTES"]
# bounds each stored value below it).
DATA_UPLOAD_MAX_MEMORY_SIZE = env_whole("AFKMEMORY_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1, unit="bytes")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AFKMEMORY = {
    "EMBEDDING_DIMENSIONS": env_whole("AFKMEMORY_EMBEDDING_DIMENSIONS", 1536, minimum=1, unit="dimensions"),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Celery's layout, with the logger's name: the app's lines sit among the worker's.
    "formatters": {"console": {"format": "[%(asctime)s: %(levelname)s/%(name)s] %(message)s"}},
    "filters": {"one_line": {"()": "project.logs.OneLineFailures"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "console"},
        "console_one_line": {"class": "logging.StreamHandler", "formatter": "console", "filters": ["one_line"]},
    },
    # Not propagated: under Celery, whose root handler would print each line a second time.
    "loggers": {
        "afkmemory": {
            "handlers": ["console"],
            "level": os.environ.get("AFKMEMORY_LOG_LEVEL", "INFO"),
            "propagate": False,
        },
        # The Redis failures the cache ignores (DJANGO_REDIS_LOG_IGNORED_EXCEPTIONS), a line each.
        "django_redis": {"handlers": ["console_one_line"], "level": "WARNING", "propagate": False},
    },
}

VAR_DIR.mkdir(parents=True, exist_ok=True)
if not REDIS_URL:
    for folder in ("out", "processed", "control"):
        (VAR_DIR / "broker" / folder).mkdir(parents=True, exist_ok=True)
