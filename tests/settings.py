"""Test settings: SQLite as ``default`` and a real PostgreSQL with pgvector as ``postgres``."""

import json
import os
import tempfile
from pathlib import Path

from project.settings import *  # noqa: F403
from project.settings import database_from_url, sqlite_database
from tests.pg import postgres_url

# Child processes of a test get the exact databases of their parent (test names included).
if os.environ.get("AFKMEMORY_TEST_DATABASES"):
    DATABASES = json.loads(os.environ["AFKMEMORY_TEST_DATABASES"])
else:
    _tmp = Path(os.environ.setdefault("AFKMEMORY_TEST_TMP", tempfile.mkdtemp(prefix="afkmemory-test-")))
    DATABASES = {
        "default": sqlite_database(_tmp / "default.sqlite3"),
        "postgres": database_from_url(postgres_url()),
    }
    # A file, not memory: other processes must open the same test database.
    DATABASES["default"]["TEST"] = {"NAME": str(_tmp / "test_default.sqlite3")}
    DATABASES["postgres"]["CONN_MAX_AGE"] = 0
    DATABASES["postgres"]["TEST"] = {"DEPENDENCIES": []}  # tests may ask for "postgres" alone
    # The same server with Django's server_side_binding option, which a deployment may turn
    # on, with prepare_threshold 1: psycopg binds every parameter server-side and prepares
    # a statement from its second run on a connection (Django's default threshold, None,
    # prepares none; 0 would prepare Django's own multi-command migration SQL, which fails).
    DATABASES["postgres_bound"] = {
        **DATABASES["postgres"],
        "OPTIONS": {
            **DATABASES["postgres"].get("OPTIONS", {}),
            "server_side_binding": True,
            "prepare_threshold": 1,
        },
        "TEST": {"DEPENDENCIES": [], "NAME": f"{DATABASES['postgres'].get('NAME') or 'postgres'}_bound_test"},
    }

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
AFKMEMORY = {"EMBEDDING_DIMENSIONS": 8, "EXACT_SEARCH_THRESHOLD": 200}
