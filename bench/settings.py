"""Django settings for the benchmarks: the example project on the benchmark's PostgreSQL.

``bench.run`` sets ``AFKMEMORY_BENCH_DATABASE_URL`` before Django starts; gunicorn's
workers for the REST workload inherit it.
"""

import os

from project import settings as _project
from project.settings import *  # noqa: F403
from project.settings import database_from_url

DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "bench.urls"

DATABASES = {"default": database_from_url(os.environ["AFKMEMORY_BENCH_DATABASE_URL"])}
# Keep connections, as a production deployment would; a new connection per request would
# measure PostgreSQL's fork, not afkmemory.
DATABASES["default"]["CONN_MAX_AGE"] = 600

# The same database under a second alias with Django's server_side_binding and psycopg's
# prepared statements (prepare_threshold 5, psycopg's default; Django's is None): what a
# deployment not behind a transaction-mode PgBouncer before 1.21 can choose. The rows
# "... on a prepared alias" run the stores on it (bench.common.PREPARED_ALIAS).
PREPARED_OPTIONS = {"server_side_binding": True, "prepare_threshold": 5}
DATABASES["prepared"] = {
    **DATABASES["default"],
    "OPTIONS": {**DATABASES["default"].get("OPTIONS", {}), **PREPARED_OPTIONS},
}
# The REST workload's second server: its default alias is the prepared one.
if os.environ.get("AFKMEMORY_BENCH_PREPARED") == "1":
    DATABASES["default"] = DATABASES["prepared"]

AFKMEMORY = {"EMBEDDING_DIMENSIONS": 384}

LOGGING = {"version": 1, "disable_existing_loggers": False}

# The API's per-account throttle stays on (both the API and the bare endpoint pay for it),
# with a rate the load generator cannot reach: the benchmark measures work, not 429s.
REST_FRAMEWORK = {
    **getattr(_project, "REST_FRAMEWORK", {}),
    "DEFAULT_THROTTLE_RATES": {"afkmemory": "1000000000/second"},
}
