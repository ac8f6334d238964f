"""REST API limits: throttling per account, body size, malformed input of every kind, and never a 500."""

from __future__ import annotations

import json
import uuid

import pytest

from afkmemory import models
from tests.api_helpers import API, ENDPOINTS, errors, state_url, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])

WRITES = [(method, path) for method, path, body in ENDPOINTS if body is not None]


def nothing_written(alias: str) -> bool:
    return not any(
        model.objects.using(alias).exists()
        for model in (models.Thread, models.Event, models.LongTermMemory, models.StoreItem)
    )


def snapshot(alias: str) -> list:
    """Everything the API can write, as plain values."""
    return [
        list(models.Thread.objects.using(alias).values_list("thread_id", "metadata", "updated_at")),
        list(models.Event.objects.using(alias).values_list("event_id")),
        list(models.StateEntry.objects.using(alias).values_list("key", "value")),
        list(models.Checkpoint.objects.using(alias).values_list("run_id")),
        list(models.LongTermMemory.objects.using(alias).values_list("memory_id", "text", "updated_at")),
        list(models.StoreItem.objects.using(alias).values_list("key", "value")),
    ]


def test_throttling_counts_per_account(api, other, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"afkmemory": "3/minute"}}
    assert [api.get(url("threads")).status_code for _ in range(3)] == [200, 200, 200]
    throttled = api.get(url("threads"))
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) > 0
    assert "throttled" in throttled.json()["detail"]
    assert other.get(url("threads")).status_code == 200  # another account has its own budget


def requests_in_this_process(token: str, count: int) -> list[int]:
    """Send ``count`` requests with ``token`` from this process (a child of ``in_processes``)."""
    from rest_framework.test import APIClient

    client = APIClient(HTTP_HOST="localhost")  # outside the test runner, ALLOWED_HOSTS has no "testserver"
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return [client.get(url("threads")).status_code for _ in range(count)]


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_with_redis_every_process_counts_against_one_budget(monkeypatch):
    """With REDIS_URL the example project keeps the throttle's counts in Redis (django-redis), so
    a second server process does not give an account a second budget."""
    import redis
    from rest_framework.authtoken.models import Token

    from tests.api_helpers import make_user
    from tests.redis_server import require_redis
    from tests.utils import in_processes

    redis_url = require_redis()
    token = Token.objects.create(user=make_user("default", f"budget-{uuid.uuid4().hex[:12]}")).key
    with redis.Redis.from_url(redis_url) as client:  # a shared Redis may hold an earlier run's count of this id
        for key in client.scan_iter(match="*throttle_afkmemory_*"):
            client.delete(key)
    monkeypatch.setenv("REDIS_URL", redis_url)  # read by the children's settings (project/settings.py)
    monkeypatch.setenv("AFKMEMORY_API_RATE", "3/minute")
    first = in_processes(requests_in_this_process, [(token, 3)])
    second = in_processes(requests_in_this_process, [(token, 2)])  # another process: the same budget
    assert (first, second) == ([[200, 200, 200]], [[429, 429]])


def test_an_oversize_body_is_413_and_writes_nothing(api, alias, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"type": "message", "payload": {"text": "x" * 1000}}
    response = api.post(url("threads", "t", "events"), body, format="json")
    assert response.status_code == 413 and "1000" in response.json()["detail"]
    assert nothing_written(alias)
    body["payload"]["text"] = "x" * 900
    assert api.post(url("threads", "t", "events"), body, format="json").status_code == 201


def test_a_body_of_more_json_values_than_the_limit_is_refused_before_it_is_checked_further(api, alias, settings):
    """4 MB of small nested arrays (two million values) took 5.5 s of a worker's CPU to refuse
    as over API_MAX_VALUE_BYTES, and a 1 MB one, stored, 1.2 s to read back each time
    (helper-103). A body holds at most API_MAX_JSON_VALUES values, object keys included."""
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_JSON_VALUES": 10}
    state = state_url("t", "k")
    # {"value": [[], [], [], [], [], [], []]}: the body, its key, the list and its 7 items are 10 values.
    assert api.put(state, {"value": [[]] * 7}, format="json").status_code == 200
    for value in ([[]] * 8, [0] * 8, {"a": [1, 2, 3, 4], "b": "[[[["}, [[[[[[[[[[]]]]]]]]]]):
        refused = api.put(state, {"value": value}, format="json")
        assert refused.status_code == 400 and "API_MAX_JSON_VALUES" in refused.json()["detail"], refused.content
    assert api.get(state).json()["value"] == [[]] * 7  # nothing written
    # Brackets in strings are not arrays: counted before the parse (more brackets than values
    # in all), they are left out, escaped quotes and backslashes included.
    assert api.put(state, {"value": ['[[[[[[[[[[{{{{{{{{{{"\\', "]]]]"]}, format="json").status_code == 200


@pytest.mark.parametrize("path", ["memories/", "store/items/", "threads/t/events/", ""])
def test_too_many_query_parameters_is_a_json_400(api, settings, path, caplog):
    """Django refuses more than DATA_UPLOAD_MAX_NUMBER_FIELDS parameters with a SuspiciousOperation,
    which reached Django's HTML "Bad Request (400)" page (helper-103)."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 5
    response = api.get(API + path + "?" + "&".join(f"a{i}=1" for i in range(6)))
    assert response.status_code == 400 and response["Content-Type"] == "application/json", response.content
    assert "DATA_UPLOAD_MAX_NUMBER_FIELDS" in response.json()["detail"]
    [record] = [r for r in caplog.records if r.name.startswith("django.security")]
    assert record.name == "django.security.TooManyFieldsSent" and record.exc_info and record.status_code == 400


def test_too_many_query_parameters_are_mailed_to_the_admins_as_a_json_400(api, settings, mailoutbox):
    """With the request in the log record, the admins' e-mail handler read its query string
    again, was refused again, and the exception escaped Django's handler: a 500, no mail
    (helper-105; Django's own pages do this too, ticket #35673)."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 5
    settings.ADMINS = [("Admin", "admin@example.com")]  # Django's logging mails django.security's errors
    response = api.get(API + "memories/?" + "&".join(f"a{i}=1" for i in range(6)))
    assert response.status_code == 400 and "DATA_UPLOAD_MAX_NUMBER_FIELDS" in response.json()["detail"]
    assert len(mailoutbox) == 1 and "TooManyFieldsSent" in mailoutbox[0].body


def test_a_string_left_open_is_read_once_to_the_end_when_brackets_are_counted(api, settings):
    """The count of brackets outside strings tried a pattern that failed on a string left open
    again from every later quote, each try to the end: 132 KB of escaped quotes took 3 s, 4 MB
    hours (helper-105). A string left open now runs to the end of the text, one match."""
    from afkmemory.api.parsers import _STRING

    left_open = '"' + '\\"' * 20_000
    assert _STRING.findall(left_open) == [left_open]
    assert _STRING.findall('"a\\"b" [ "c\\\\" ] "d') == ['"a\\"b"', '"c\\\\"', '"d']
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_JSON_VALUES": 10}
    body = "[" * 11 + left_open
    refused = api.put(state_url("t", "k"), body, content_type="application/json")
    assert refused.status_code == 400 and "API_MAX_JSON_VALUES" in refused.json()["detail"]


@pytest.mark.parametrize(("charset", "status"), [("utf-8", 200), ("utf-16", 200), ("punycode", 400), ("cp1252", 400)])
def test_a_body_in_a_charset_json_does_not_use_is_refused(api, charset, status):
    """Any charset Python has a codec for was decoded, punycode's quadratic in the body's size
    (640 KB: 5.6 s, helper-105): JSON is UTF-8 (RFC 8259; UTF-16 and UTF-32 as RFC 4627 had it)."""
    body = json.dumps({"value": "x"}).encode(charset)
    response = api.put(state_url("t", "k"), body, content_type=f"application/json; charset={charset}")
    assert response.status_code == status, response.content
    if status == 400:
        assert "charset" in response.json()["detail"]


# Bodies no endpoint may take: each must be a 400 (or 415 for the wrong type), never a 500.
MALFORMED = [
    b"{",
    b'{"a": NaN}',
    b'{"a": Infinity}',
    b'{"a": "\\ud800"}',  # a lone surrogate: valid JSON, unstorable text
    b"[" * 5000 + b"]" * 5000,  # deeper than Python's recursion limit
    b"[" * 150 + b"]" * 150,  # deeper than MAX_JSON_DEPTH
    b"\xff\xfe{}",
    b"1" * 5000,  # a number with too many digits for int()
    b"null",
    b'"text"',
    b"[]",
    b"[[]]",
    b"[null]",
    b'{"namespace": [["a"]], "key": {}, "value": [], "thread_id": [], "type": {}, "user_id": [], "id": []}',
]


@pytest.mark.parametrize(("method", "path"), WRITES)
def test_malformed_bodies_are_refused_with_400(api, alias, method, path):
    # The objects the PATCHes address exist, so their 400 is not hidden behind a 404.
    assert api.post(url("threads"), {"thread_id": "t"}, format="json").status_code == 201
    assert api.post(url("memories"), {"id": "m", "text": "kept"}, format="json").status_code == 201
    before = snapshot(alias)
    send = getattr(api, method)
    for body in MALFORMED:
        response = send(API + path, body, content_type="application/json")
        assert response.status_code == 400, (body[:40], response.status_code, response.content[:200])
        assert isinstance(response.json(), dict)
    assert send(API + path, b"{}", content_type="text/plain").status_code == 415
    assert snapshot(alias) == before


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_options_and_odd_query_strings_never_fail(api, method, path, body):
    refused = api.options(API + path)
    assert refused.status_code == 405 and method.upper() in refused["Allow"]
    assert "OPTIONS" not in refused["Allow"]  # it listed the method it refused
    junk = "%00&limit=-1&offset=x&cursor=%ff&since_ms=1e3&namespace=&key=%00&run_id=a:b&prefix=%00&page_size=0"
    joined = API + path + ("&" if "?" in path else "?") + junk
    response = getattr(api, method)(joined, body, format="json")
    assert response.status_code < 500, (method, path, response.status_code)


def test_refusals_name_the_field(api):
    problems = errors(api.post(url("memories", "search"), {"user_id": "u", "embedding": [1, 2]}, format="json"))
    assert "embedding" in problems and "8" in problems["embedding"][0]
    problems = errors(api.put(url("store", "items"), {"namespace": ["a", ""], "key": "k", "value": 1}, format="json"))
    assert problems == {"namespace": ["namespace segment 1 must not be empty"]}
    parse = errors(api.post(url("threads"), b"{nope", content_type="application/json"))
    assert json.dumps(parse).startswith('{"detail": "JSON parse error')


def test_unknown_urls_under_the_api_answer_json_404(api):
    for path in ("nope/", "threads", "threads/t/state", "threads/t/events/x/"):
        response = api.get(API + path)
        assert response.status_code == 404 and "No endpoint" in response.json()["detail"], path


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_a_token_clients_write_to_an_unknown_url_gets_the_json_404_not_a_csrf_page(alice, alias, method):
    """A missing trailing slash is the commonest mistyped URL; Django's CSRF check answered it (an
    HTML 403) before the JSON 404 with its hint, for a client that has no CSRF cookie."""
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    client = APIClient(enforce_csrf_checks=True)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.db_manager(alias).create(user=alice).key}")
    response = getattr(client, method)(API + "threads/t/events", {"type": "message"}, format="json")
    assert response.status_code == 404, (response.status_code, response["Content-Type"])
    assert "endpoints end with '/'" in response.json()["detail"]


def test_the_schema_states_the_byte_limits_its_max_lengths_cannot(api):
    """JSON Schema's maxLength counts characters; the server counts UTF-8 bytes. The schema
    says so (``x-max-bytes``), and a value within maxLength but over the bytes is a 400."""
    schema = api.get(API + "schema/", HTTP_ACCEPT="application/json").json()
    event = schema["components"]["schemas"]["Event"]["properties"]["id"]
    assert (event["maxLength"], event["x-max-bytes"]) == (255, 255)
    [key] = [p for p in schema["paths"]["/api/v1/threads/{thread_id}/state/{key}"]["get"]["parameters"]
             if p["name"] == "key"]  # fmt: skip
    assert key["schema"]["x-max-bytes"] == 1024
    response = api.post(url("threads/t/events"), {"id": "é" * 200, "type": "message"}, format="json")
    assert response.status_code == 400 and "id" in errors(response)
    # The path's ids too, which the router documented by their URL pattern alone.
    for path, name in (("/api/v1/threads/{thread_id}/", "thread_id"), ("/api/v1/memories/{id}/", "id")):
        [parameter] = schema["paths"][path]["get"]["parameters"]
        assert (parameter["name"], parameter["schema"]) == (
            name,
            {"type": "string", "minLength": 1, "maxLength": 255, "x-max-bytes": 255, "pattern": "^[^/\\x00]+$"},
        )
    for collection in ("threads", "memories"):
        response = api.get(url(collection, "é" * 200))
        assert response.status_code == 400, response.content


def test_the_schemas_version_is_its_own_not_the_callers(api):
    """drf-spectacular wrote ``schema/?version=`` unchecked into Content-Disposition: a line
    break in it was a 500, a quote added header parameters of the caller's choosing."""
    accept = "application/vnd.oai.openapi+json"
    for version in ("a\r\nX-Injected: 1", 'x"; filename="evil.html'):
        response = api.get(API + "schema/", {"version": version}, HTTP_ACCEPT=accept)
        assert response.status_code == 200
        assert response.headers["Content-Disposition"] == 'inline; filename="afkmemory API (1).json"'
