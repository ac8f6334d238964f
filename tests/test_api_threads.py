"""REST API: threads, their events and compaction, on SQLite and PostgreSQL, with two tenants."""

from __future__ import annotations

import pytest

from afkmemory import models
from tests.api_helpers import errors, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


def ev(i: int, *, ts: int | None = None, kind: str = "message", **extra) -> dict:
    return {"id": f"e{i}", "type": kind, "timestamp": i if ts is None else ts, "payload": {"n": i}, **extra}


def event_ids(response) -> list[str]:
    assert response.status_code == 200, response.json()
    return [event["id"] for event in response.json()["results"]]


# -- threads ------------------------------------------------------------------------------------


def test_thread_lifecycle(api, alias):
    created = api.post(url("threads"), {"thread_id": "t.1:x", "metadata": {"topic": "tea"}}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["thread_id"] == "t.1:x" and created.json()["metadata"] == {"topic": "tea"}

    assert api.get(url("threads", "t.1:x")).json()["metadata"] == {"topic": "tea"}
    patched = api.patch(url("threads", "t.1:x"), {"metadata": {"topic": "coffee"}}, format="json")
    assert patched.status_code == 200 and patched.json()["metadata"] == {"topic": "coffee"}
    assert models.Thread.objects.using(alias).get().metadata == {"topic": "coffee"}

    api.post(url("threads", "t.1:x", "events"), ev(1), format="json")
    assert api.delete(url("threads", "t.1:x")).status_code == 204
    assert api.get(url("threads", "t.1:x")).status_code == 404
    assert not models.Event.objects.using(alias).exists()  # its events went with it


def test_thread_list_pages_are_capped_and_strict(api, settings):
    for i in range(5):
        assert api.post(url("threads"), {"thread_id": f"t{i}"}, format="json").status_code == 201
    page = api.get(url("threads", limit=2, offset=1)).json()
    assert page["count"] == 5 and [t["thread_id"] for t in page["results"]] == ["t1", "t2"]
    assert page["next"] is not None
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": 3}
    assert "limit" in errors(api.get(url("threads", limit=4)))
    assert len(api.get(url("threads", limit=3)).json()["results"]) == 3
    assert len(api.get(url("threads")).json()["results"]) == 3  # the default page is capped too
    for bad in ("-1", "0", "1.5", "ten", ""):
        assert "limit" in errors(api.get(url("threads", limit=bad)))
    assert "offset" in errors(api.get(url("threads", offset=-1)))


def test_thread_input_is_refused_whole(api, alias):
    assert "thread_id" in errors(api.post(url("threads"), {"thread_id": 5}, format="json"))
    assert "thread_id" in errors(api.post(url("threads"), {"thread_id": "a/b"}, format="json"))
    for dots in (".", ".."):  # HTTP clients resolve threads/./ and threads/../ away: no URL names them
        assert "thread_id" in errors(api.post(url("threads"), {"thread_id": dots}, format="json"))
    assert "thread_id" in errors(api.post(url("threads"), {"thread_id": ""}, format="json"))
    assert "thread_id" in errors(api.post(url("threads"), {"thread_id": "x" * 256}, format="json"))
    assert "metadata" in errors(api.post(url("threads"), {"thread_id": "t", "metadata": [1]}, format="json"))
    assert not models.Thread.objects.using(alias).exists()
    api.post(url("threads"), {"thread_id": "t"}, format="json")
    again = api.post(url("threads"), {"thread_id": "t"}, format="json")  # 409, as a duplicate event is
    assert again.status_code == 409 and "already have a thread 't'" in again.json()["detail"]
    assert "thread_id" in errors(api.patch(url("threads", "t"), {"thread_id": "u"}, format="json"))
    assert api.put(url("threads", "t"), {"thread_id": "t"}, format="json").status_code == 405
    assert "thread_id" in errors(api.get(url("threads", "nul\x00")))


def test_a_patch_racing_a_delete_does_not_bring_the_thread_back(api, alias, monkeypatch):
    """The PATCH read the thread, a DELETE answered 204, then the PATCH's Model.save() updated
    no row and INSERTed it again, old created_at and all (over HTTP: 20 rounds of 20)."""
    from afkmemory.api import views

    assert api.post(url("threads"), {"thread_id": "t", "metadata": {"a": 1}}, format="json").status_code == 201
    read = views.ThreadViewSet.get_object

    def read_then_a_rival_deletes(self):
        thread = read(self)
        models.Thread.objects.using(alias).filter(pk=thread.pk).delete()  # the racing DELETE's 204
        return thread

    monkeypatch.setattr(views.ThreadViewSet, "get_object", read_then_a_rival_deletes)
    patched = api.patch(url("threads", "t"), {"metadata": {"b": 2}}, format="json")
    assert patched.status_code == 404 and not models.Thread.objects.using(alias).exists()
    monkeypatch.undo()
    assert api.patch(url("threads", "t"), {"metadata": {"b": 2}}, format="json").status_code == 404


def test_threads_belong_to_their_creator(api, other, alice, bob, alias):
    """Ownership comes from the request's account, never the body; other tenants get 404 everywhere."""
    refused = api.post(url("threads"), {"thread_id": "t", "owner": bob.pk}, format="json")
    assert "owner" in errors(refused) and not models.Thread.objects.using(alias).exists()
    api.post(url("threads"), {"thread_id": "t", "metadata": {"v": 1}}, format="json")
    assert models.Thread.objects.using(alias).get().owner_id == alice.pk

    assert other.get(url("threads")).json()["count"] == 0
    assert other.get(url("threads", "t")).status_code == 404
    assert other.patch(url("threads", "t"), {"metadata": {"v": 2}}, format="json").status_code == 404
    assert other.delete(url("threads", "t")).status_code == 404
    assert other.post(url("threads", "t", "compact"), {}, format="json").status_code == 404
    assert api.get(url("threads", "t")).json()["metadata"] == {"v": 1}

    # The same thread id is another thread in Bob's account.
    assert other.post(url("threads"), {"thread_id": "t", "metadata": {"v": "bob"}}, format="json").status_code == 201
    assert api.get(url("threads", "t")).json()["metadata"] == {"v": 1}
    assert [t["metadata"] for t in other.get(url("threads")).json()["results"]] == [{"v": "bob"}]


def test_thread_cursor_pages_list_every_thread_once_by_id(api, other, alias, settings):
    from tests.test_api_memories import cursor_of, walk

    ids = ["t9", "t10", "T", "a.b", "t:x", "té", "t\u2603", 't"q', "t 1", "t~", "t0", "t00", "t1"]
    for thread_id in ids:
        assert api.post(url("threads"), {"thread_id": thread_id}, format="json").status_code == 201
    assert other.post(url("threads"), {"thread_id": "t5"}, format="json").status_code == 201  # Bob's
    by_code_point = sorted(ids)
    pages = walk(api, "threads", page_size=4)
    assert pages == [by_code_point[i : i + 4] for i in range(0, len(ids), 4)]
    assert walk(api, "threads", page_size=len(ids)) == [by_code_point]
    assert walk(other, "threads", page_size=4) == [["t5"]]
    assert set(api.get(url("threads")).json()) == {"count", "next", "previous", "results"}  # the default

    # Deleted and created during a walk: the cursor is a position, not a row, so the walk goes on.
    first = api.get(url("threads", page_size=4))
    assert api.delete(url("threads", by_code_point[3])).status_code == 204  # the cursor's own thread
    assert api.post(url("threads"), {"thread_id": "t00a"}, format="json").status_code == 201  # after the cursor
    assert api.post(url("threads"), {"thread_id": "A"}, format="json").status_code == 201  # before it: missed
    rest = [i for page in walk(api, "threads", page_size=4, cursor=cursor_of(first)) for i in page]
    assert rest == sorted([*by_code_point[4:], "t00a"])

    # Bob following Alice's link is refused; so is an altered cursor, and one from before a key change.
    assert "cursor" in errors(other.get(first.json()["next"]))
    encoded, tag = cursor_of(first).rsplit(".", 1)
    assert "cursor" in errors(api.get(url("threads", page_size=4, cursor=f"{encoded}.{tag[::-1]}")))
    old_key, settings.SECRET_KEY = settings.SECRET_KEY, "another key"
    assert "cursor" in errors(api.get(first.json()["next"]))
    settings.SECRET_KEY_FALLBACKS = [old_key]  # rotated as Django says: the walk goes on
    assert [i for page in walk(api, "threads", page_size=4, cursor=cursor_of(first)) for i in page] == rest


# -- events -------------------------------------------------------------------------------------


def test_append_one_event_or_a_list(api):
    one = api.post(url("threads", "t", "events"), {"type": "message", "payload": {"text": "hi"}}, format="json")
    assert one.status_code == 201, one.json()
    body = one.json()
    assert body["id"].startswith("evt_") and body["thread_id"] == "t" and body["timestamp"] > 0
    assert body["user_id"] is None and body["tags"] == []

    many = api.post(url("threads", "t", "events"), [ev(1, user_id="u1", tags=["x"]), ev(2)], format="json")
    assert many.status_code == 201
    assert [e["id"] for e in many.json()] == ["e1", "e2"] and many.json()[0]["user_id"] == "u1"
    assert api.get(url("threads", "t")).status_code == 200  # the thread was created by the append


def test_an_append_answers_the_events_as_a_read_renders_them(api):
    # The serializer that validated the body renders the answer: every field must be there.
    full = {"id": "f", "user_id": "u", "type": "tool_call", "timestamp": 5, "payload": {"a": [1]}, "tags": ["x"]}
    one = api.post(url("threads", "t", "events"), full, format="json").json()
    many = api.post(url("threads", "t", "events"), [ev(1), ev(2, user_id="u2")], format="json").json()
    assert one == {**full, "thread_id": "t"}
    read = api.get(url("threads", "t", "events"), {"limit": 10}).json()["results"]
    assert sorted([one, *many], key=lambda e: e["id"]) == sorted(read, key=lambda e: e["id"])


def test_event_reads_recent_since_and_cursor(api):
    # Equal timestamps (3 events at 7) must keep insertion order and never repeat across pages.
    events = [ev(0), ev(1, ts=7), ev(2, ts=7), ev(3, ts=7), ev(4, ts=9), ev(5, ts=10), ev(6, ts=11)]
    assert api.post(url("threads", "t", "events"), events, format="json").status_code == 201
    everything = ["e0", "e1", "e2", "e3", "e4", "e5", "e6"]

    assert event_ids(api.get(url("threads", "t", "events", limit=3))) == ["e4", "e5", "e6"]
    assert event_ids(api.get(url("threads", "t", "events", limit=0))) == []
    assert event_ids(api.get(url("threads", "t", "events", since_ms=7, limit=2))) == ["e1", "e2"]
    assert event_ids(api.get(url("threads", "t", "events", since_ms=10))) == ["e5", "e6"]
    assert api.get(url("threads", "t", "events", limit=3)).json()["next"] is None

    seen, page = [], api.get(url("threads", "t", "events", page_size=2))
    while True:
        seen += event_ids(page)
        if page.json()["next"] is None:
            break
        page = api.get(page.json()["next"])
    assert seen == everything

    walked = api.get(url("threads", "t", "events", page_size=2, since_ms=7))
    assert event_ids(walked) == ["e1", "e2"]
    assert event_ids(api.get(walked.json()["next"])) == ["e3", "e4"]


def test_event_list_input_errors(api):
    api.post(url("threads", "t", "events"), ev(1), format="json")
    for query in ({"limit": -1}, {"limit": 501}, {"limit": "x"}, {"since_ms": "soon"}, {"page_size": 0}):
        (name,) = query
        assert name in errors(api.get(url("threads", "t", "events", **query)))
    assert "cursor" in errors(api.get(url("threads", "t", "events", cursor="bm90LWEtY3Vyc29y")))
    assert "cursor" in errors(api.get(url("threads", "t", "events", cursor="%%%")))
    assert "cursor" in errors(api.get(url("threads", "t", "events", limit=1, cursor="MS4x")))
    assert api.get(url("threads", "missing", "events")).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"type": "shout"}, "type"),
        ({"type": 1}, "type"),
        ({}, "type"),
        ({"type": "message", "timestamp": "5"}, "timestamp"),
        ({"type": "message", "timestamp": -1}, "timestamp"),
        ({"type": "message", "timestamp": 2**60}, "timestamp"),
        ({"type": "message", "payload": [1]}, "payload"),
        ({"type": "message", "payload": {"t": "nul\x00"}}, "payload"),
        ({"type": "message", "tags": "x"}, "tags"),
        ({"type": "message", "id": 5}, "id"),
        ({"type": "message", "id": " "}, None),  # a blank id is a valid id: nothing is trimmed
        ({"type": "message", "user_id": ""}, "user_id"),
        ({"type": "message", "thread_id": "elsewhere"}, "thread_id"),  # it landed in "t"
        ({"type": "message", "thread_id": "t"}, None),  # an event read from the API can be sent back
    ],
)
def test_bad_events_are_refused_and_nothing_is_written(api, alias, body, field):
    response = api.post(url("threads", "t", "events"), [ev(1), body], format="json")
    if field is None:
        assert response.status_code == 201
        return
    assert field in errors(response)["1"]  # the second event's field is named
    assert not models.Event.objects.using(alias).exists()
    assert not models.Thread.objects.using(alias).exists()


def test_a_lone_event_naming_another_thread_is_refused(api, alias):
    response = api.post(url("threads", "t", "events"), {"type": "message", "thread_id": "u"}, format="json")
    assert "differs from the URL's 't'" in errors(response)["thread_id"][0]
    assert not models.Event.objects.using(alias).exists()


def test_a_list_with_a_taken_or_repeated_id_writes_nothing(api, alias):
    api.post(url("threads", "t", "events"), ev(1), format="json")
    conflict = api.post(url("threads", "t", "events"), [ev(2), ev(1)], format="json")
    assert conflict.status_code == 409 and "e1" in conflict.json()["detail"]
    assert "id" in errors(api.post(url("threads", "t", "events"), [ev(3), ev(3)], format="json"))
    assert "non_field_errors" in errors(api.post(url("threads", "t", "events"), [], format="json"))
    assert "non_field_errors" in errors(api.post(url("threads", "t", "events"), 7, format="json"))
    assert list(models.Event.objects.using(alias).values_list("event_id", flat=True)) == ["e1"]


def test_events_of_another_tenant_answer_404(api, other, alias):
    api.post(url("threads", "t", "events"), [ev(1), ev(2)], format="json")
    assert other.get(url("threads", "t", "events")).status_code == 404
    assert other.get(url("threads", "t", "events", limit=5)).status_code == 404
    # Bob appending to "t" appends to his own thread "t", not Alice's.
    assert other.post(url("threads", "t", "events"), ev(1), format="json").status_code == 201
    assert event_ids(other.get(url("threads", "t", "events"))) == ["e1"]
    assert event_ids(api.get(url("threads", "t", "events"))) == ["e1", "e2"]


# -- compaction ---------------------------------------------------------------------------------


def test_compaction_applies_the_policy_and_returns_counts(api):
    events = [ev(i, kind="trace" if i % 4 == 0 else "message") for i in range(10)]
    api.post(url("threads", "t", "events"), events, format="json")
    response = api.post(url("threads", "t", "compact"), {"max_events_per_thread": 4}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json() == {"events_before": 10, "events_after": 4, "events_removed": 6}
    # Traces are kept first (AFK's default keep_event_types), then the newest others.
    assert event_ids(api.get(url("threads", "t", "events"))) == ["e0", "e4", "e8", "e9"]
    assert api.post(url("threads", "missing", "compact"), {}, format="json").status_code == 404


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"max_events_per_thread": -1}, "max_events_per_thread"),
        ({"max_events_per_thread": "5"}, "max_events_per_thread"),
        ({"scan_limit": 0}, "scan_limit"),
        ({"keep_event_types": ["nope"]}, "keep_event_types"),
        ({"keep_event_types": "trace"}, "keep_event_types"),
    ],
)
def test_bad_policies_are_refused(api, alias, policy, field):
    api.post(url("threads", "t", "events"), [ev(1), ev(2)], format="json")
    assert field in errors(api.post(url("threads", "t", "compact"), policy, format="json"))
    assert models.Event.objects.using(alias).count() == 2


def test_compaction_of_another_tenants_thread_answers_404(api, other, alias):
    api.post(url("threads", "t", "events"), [ev(1), ev(2)], format="json")
    assert other.post(url("threads", "t", "compact"), {"max_events_per_thread": 0}, format="json").status_code == 404
    assert models.Event.objects.using(alias).count() == 2


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "threads/%2E/events/", {"type": "message"}),
        ("put", "threads/%2E/state/k", {"value": 1}),
        ("post", "threads/%2E%2E/checkpoints/", {"run_id": "r", "step": 0, "phase": "p", "payload": None}),
    ],
)
def test_writes_that_make_a_thread_refuse_the_ids_post_threads_refuses(api, alias, method, path, body):
    """``threads/%2E/...`` spells thread ``.``, which clients that resolve dot segments can never name."""
    from tests.api_helpers import API

    assert "thread_id" in errors(getattr(api, method)(API + path, body, format="json"))
    assert not models.Thread.objects.using(alias).exists()


def test_an_event_cursor_tells_nothing_of_other_accounts_events(api, other, alias, settings):
    """The cursor carried the last event's row id, which every account's events share: the gap
    between the ids in two of an account's cursors counted the events all accounts appended
    in between. It carries the id masked, and signed: an altered cursor is refused."""
    import base64
    from urllib.parse import parse_qs, urlsplit

    api.post(url("threads", "t", "events"), [ev(0), ev(1)], format="json")
    other.post(url("threads", "t", "events"), [ev(i) for i in range(10, 15)], format="json")  # unseen by api
    api.post(url("threads", "t", "events"), [ev(2), ev(3)], format="json")
    page = api.get(url("threads", "t", "events", page_size=2))
    [cursor] = parse_qs(urlsplit(page.json()["next"]).query)["cursor"]
    text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    timestamp, masked, tag = text.split(".")
    pks = models.Event.objects.using(alias).values_list("pk", flat=True)
    assert int(masked) not in pks and max(pks) - min(pks) == 8  # no row id in it, though the ids run on
    assert event_ids(api.get(page.json()["next"])) == ["e2", "e3"]
    altered = base64.urlsafe_b64encode(f"{timestamp}.{int(masked) + 1}.{tag}".encode()).decode().rstrip("=")
    assert "cursor" in errors(api.get(url("threads", "t", "events", cursor=altered)))
    old_key, settings.SECRET_KEY = settings.SECRET_KEY, "another key"  # rotated: old cursors are refused,
    assert "cursor" in errors(api.get(page.json()["next"]))  # not read as another place
    settings.SECRET_KEY_FALLBACKS = [old_key]  # unless the old key is a fallback, as Django's signing has it
    following = api.get(page.json()["next"])
    assert event_ids(following) == ["e2", "e3"] and following.json()["next"] is None
    more = [ev(4), ev(5), ev(6)]
    api.post(url("threads", "t", "events"), more, format="json")
    newer = api.get(page.json()["next"])  # an old cursor's next link is made under the new key
    settings.SECRET_KEY_FALLBACKS = []
    assert event_ids(newer) == ["e2", "e3"] and event_ids(api.get(newer.json()["next"])) == ["e4", "e5"]


def test_an_event_cursor_is_refused_on_another_thread_account_or_since(api, other):
    """Event cursors are signed with the account, the thread and ``since_ms``, as the memory and
    thread lists' cursors are: a position in one thread read in another was a page from
    somewhere else (and another account's thread of the same id took the same link)."""
    for client in (api, other):
        for thread in ("t", "u"):
            client.post(url("threads", thread, "events"), [ev(i) for i in range(4)], format="json")
    next_link = api.get(url("threads", "t", "events", page_size=2, since_ms=1)).json()["next"]
    assert event_ids(api.get(next_link)) == ["e3"]
    cursor = next_link.rsplit("cursor=", 1)[1].split("&")[0]
    assert "cursor" in errors(api.get(url("threads", "u", "events", page_size=2, since_ms=1, cursor=cursor)))
    assert "cursor" in errors(api.get(url("threads", "t", "events", page_size=2, since_ms=0, cursor=cursor)))
    assert "cursor" in errors(api.get(url("threads", "t", "events", page_size=2, cursor=cursor)))
    assert "cursor" in errors(other.get(next_link))  # bob has a thread "t" too
    assert event_ids(api.get(url("threads", "t", "events", page_size=5, since_ms=1, cursor=cursor))) == ["e3"]
    # since_ms as the number it names, and no other parameter: a cache-buster keeps the cursor.
    assert event_ids(api.get(url("threads", "t", "events", since_ms="01", cursor=cursor, _="1733"))) == ["e3"]
