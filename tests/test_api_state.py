"""REST API: thread state and run checkpoints, on SQLite and PostgreSQL, with two tenants."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from afkmemory import models
from afkmemory.stores import SyncDjangoMemoryStore
from tests.api_helpers import errors, state_url, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


def put(client, thread_id: str, key: str, value) -> None:
    response = client.put(state_url(thread_id, key), {"value": value}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json() == {"key": key, "value": value}


# -- state --------------------------------------------------------------------------------------


def test_of_racing_deletes_of_a_state_key_one_answers_204(api, alias, monkeypatch):
    """The view looked the key up, then deleted it without checking it deleted anything: of
    16 racing DELETEs over HTTP, two answered 204 in most rounds. Now the delete decides."""
    from afkmemory.stores import SyncDjangoMemoryStore

    put(api, "t", "k", 1)
    delete = SyncDjangoMemoryStore.delete_state

    def a_rival_deletes_first(self, thread_id, key):
        models.StateEntry.objects.using(alias).filter(key=key).delete()  # the racing DELETE's 204
        return delete(self, thread_id, key)

    monkeypatch.setattr(SyncDjangoMemoryStore, "delete_state", a_rival_deletes_first)
    assert api.delete(state_url("t", "k")).status_code == 404


def test_state_keys_round_trip(api):
    keys = {
        "plan": {"steps": [1, 2]},
        "checkpoint:run-1:latest": {"key": "checkpoint:run-1:3:step_end"},
        "checkpoint:run-1:3:step_end": {"payload": {"x": 1}},
        "effect:run-1:2:call/7": {"input_hash": "h", "output": [1]},
        "a/b?c#d e%": "odd characters survive the URL",
        "two\nlines": "a newline too",
        "nothing": None,
    }
    for key, value in keys.items():
        put(api, "t", key, value)
    for key, value in keys.items():
        response = api.get(state_url("t", key))
        assert response.status_code == 200 and response.json() == {"key": key, "value": value}, key
    # A slash in the key needs no escaping: the key is the rest of the path.
    assert api.get(url("threads", "t", "state") + "a/b%3Fc%23d%20e%25").json()["value"] == keys["a/b?c#d e%"]

    assert api.get(url("threads", "t", "state")).json()["state"] == dict(sorted(keys.items()))
    listed = api.get(url("threads", "t", "state", prefix="checkpoint:run-1:")).json()["state"]
    assert listed == {k: v for k, v in keys.items() if k.startswith("checkpoint:run-1:")}

    assert api.delete(state_url("t", "nothing")).status_code == 204
    assert api.get(state_url("t", "nothing")).status_code == 404
    assert api.delete(state_url("t", "nothing")).status_code == 404
    assert api.delete(state_url("t", "effect:run-1:2:call/7")).status_code == 204
    assert "effect:run-1:2:call/7" not in api.get(url("threads", "t", "state")).json()["state"]


def test_state_misses_answer_404(api):
    assert api.get(url("threads", "t", "state")).status_code == 404
    assert api.get(state_url("t", "k")).status_code == 404
    put(api, "t", "k", 1)
    assert api.get(state_url("t", "other")).status_code == 404


@pytest.mark.parametrize(
    "key", [f"checkpoint:r:{2**64}:x", "checkpoint:r:1:" + "p" * 300, "effect:" + "r" * 300 + ":1:c"]
)
def test_a_checkpoint_key_whose_parts_do_not_fit_their_columns_is_a_plain_key(api, key):
    """Not a checkpoint (none can have such a step, run id or phase): stored, read and deleted as any key."""
    put(api, "t", key, {"payload": 1})
    assert api.get(state_url("t", key)).json()["value"] == {"payload": 1}
    assert api.get(url("threads", "t", "state")).json()["state"] == {key: {"payload": 1}}
    assert api.delete(state_url("t", key)).status_code == 204
    assert api.get(state_url("t", key)).status_code == 404


def test_bad_state_writes_are_refused_and_write_nothing(api, alias, settings):
    assert "value" in errors(api.put(state_url("t", "k"), {}, format="json"))
    assert "value" in errors(api.put(state_url("t", "k"), {"value": {"a": "nul\x00"}}, format="json"))
    assert "key" in errors(api.put(state_url("t", "nul\x00"), {"value": 1}, format="json"))
    assert "key" in errors(api.put(state_url("t", "k" * 1025), {"value": 1}, format="json"))
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_VALUE_BYTES": 100}
    assert "value" in errors(api.put(state_url("t", "k"), {"value": "x" * 200}, format="json"))
    assert not models.Thread.objects.using(alias).exists()
    put(api, "t", "k", "x" * 90)
    assert "prefix" in errors(api.get(url("threads", "t", "state", prefix="nul\x00")))


def test_state_of_another_tenant_answers_404(api, other):
    put(api, "t", "checkpoint:run-1:latest", {"v": "alice"})
    put(api, "t", "plan", 1)
    assert other.get(url("threads", "t", "state")).status_code == 404
    assert other.get(state_url("t", "plan")).status_code == 404
    assert other.get(state_url("t", "checkpoint:run-1:latest")).status_code == 404
    assert other.delete(state_url("t", "plan")).status_code == 404
    # Bob's PUT goes to his own thread "t".
    put(other, "t", "plan", 2)
    assert other.get(url("threads", "t", "state")).json()["state"] == {"plan": 2}
    assert api.get(state_url("t", "plan")).json()["value"] == 1
    assert api.get(state_url("t", "checkpoint:run-1:latest")).json()["value"] == {"v": "alice"}


# -- state pages --------------------------------------------------------------------------------


def awkward_state(owner, alias: str, thread_id: str = "t") -> SyncDjangoMemoryStore:
    """Plain, checkpoint and effect keys of one thread whose text order is not their columns' order."""
    store = SyncDjangoMemoryStore(owner=owner, using=alias)
    store.put_state_many(
        thread_id,
        {
            "plan": {"steps": [1, 2]},
            "nothing": None,
            "checkpoint:a:01:x": "not canonical: a plain key between checkpoints",
            "effect:a-1:1": "three parts: plain",
            "a&b=c+d %/?#\t": "odd characters survive the next link",
            "é": "after every ASCII key",
        },
    )
    for run_id in ("a", "a-1", "a0", "b"):  # in text, "a-1:" and "a0:" come before "a:"
        for step in (0, 1, 2, 9, 10, 11, 100):  # and step 10 before step 9
            store.write_checkpoint(thread_id, run_id, step, "pre_llm", {"step": step})
            store.record_effect(thread_id, run_id, step, f"call:{step}", input_hash="h", output=[run_id, step])
    return store


def walk(client, thread_id: str = "t", **query) -> list[list[tuple[str, object]]]:
    """Return the pages of the thread's state, following ``next`` from the first."""
    pages = []
    response = client.get(url("threads", thread_id, "state", **query))
    while True:
        assert response.status_code == 200, response.json()
        body = response.json()
        assert list(body) == ["state", "next"]
        pages.append(list(body["state"].items()))
        if body["next"] is None:
            return pages
        assert body["next"].startswith("http://testserver" + url("threads", thread_id, "state") + "?"), body["next"]
        response = client.get(body["next"])


@pytest.mark.parametrize("prefix", [None, "checkpoint:", "checkpoint:a", "checkpoint:a:1", "effect:a-1:", "a&", "none"])
@pytest.mark.parametrize("limit", [1, 6, None])
def test_state_pages_walk_the_whole_state_in_key_order(api, alice, alias, prefix, limit):
    """Following next gives list_state's entries in its order, each once, in full pages but the last."""
    store = awkward_state(alice, alias)
    query = {key: value for key, value in (("prefix", prefix), ("limit", limit)) if value is not None}
    pages = walk(api, **query)
    expected = list(store.list_state("t", prefix).items())
    assert [entry for page in pages for entry in page] == expected
    size = limit or 100
    assert all(len(page) == size for page in pages[:-1]), [len(page) for page in pages]
    assert 0 < len(pages[-1]) <= size or expected == []
    assert len(pages) == max(1, -(-len(expected) // size))


def test_a_state_page_starts_after_any_key_and_keeps_the_query(api, alice, alias):
    store = awkward_state(alice, alias)
    everything = list(store.list_state("t"))
    body = api.get(url("threads", "t", "state", after="checkpoint:a:5", limit=3)).json()  # no such key
    assert list(body["state"]) == [key for key in everything if key > "checkpoint:a:5"][:3]
    assert list(body["state"]) == ["checkpoint:a:9:pre_llm", "checkpoint:a:latest", "checkpoint:b:0:pre_llm"]
    query = parse_qs(urlsplit(body["next"]).query)
    assert query == {"after": ["checkpoint:b:0:pre_llm"], "limit": ["3"]}
    body = api.get(url("threads", "t", "state", prefix="effect:a:", after="effect:a:100:call:100", limit=2)).json()
    assert list(body["state"]) == ["effect:a:10:call:10", "effect:a:11:call:11"]
    assert parse_qs(urlsplit(body["next"]).query)["prefix"] == ["effect:a:"]
    # An empty after is no after, as an empty prefix is no prefix.
    assert api.get(url("threads", "t", "state", after="", prefix="")).json()["state"] == dict(
        list(store.list_state("t").items())[:100]
    )
    assert api.get(url("threads", "t", "state", after="\U0010ffff")).json() == {"state": {}, "next": None}


def test_state_page_limits(api, alice, alias, settings):
    SyncDjangoMemoryStore(owner=alice, using=alias).put_state_many("t", {f"k{i:03}": i for i in range(101)})
    first = api.get(url("threads", "t", "state")).json()
    assert list(first["state"]) == [f"k{i:03}" for i in range(100)]  # the default page: 100
    assert api.get(first["next"]).json() == {"state": {"k100": 100}, "next": None}
    assert len(api.get(url("threads", "t", "state", limit=500)).json()["state"]) == 101
    assert "limit" in errors(api.get(url("threads", "t", "state", limit=501)))
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": 5}
    assert len(api.get(url("threads", "t", "state")).json()["state"]) == 5  # the default is capped too
    assert len(api.get(url("threads", "t", "state", limit=5)).json()["state"]) == 5
    assert "from 1 to 5" in errors(api.get(url("threads", "t", "state", limit=6)))["limit"][0]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "1.5"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"limit": "\uff11"}, "limit"),  # a full-width 1: a digit to str.isdigit, not to the API
        ({"after": "nul\x00"}, "after"),
        ({"after": "k" * 1025}, "after"),
        ({"after": "é" * 513}, "after"),  # 1026 bytes
        ({"prefix": "nul\x00"}, "prefix"),
    ],
)
def test_bad_state_page_parameters_answer_400_naming_them(api, alias, query, field):
    put(api, "t", "k", 1)
    assert field in errors(api.get(url("threads", "t", "state", **query)))
    assert field in errors(api.get(url("threads", "missing", "state", **query)))  # checked before the thread


def test_state_pages_of_another_tenant_answer_404(api, other, alice, alias):
    awkward_state(alice, alias)
    assert other.get(url("threads", "t", "state", after="a", limit=2)).status_code == 404
    put(other, "t", "plan", 2)
    assert walk(other, limit=1) == [[("plan", 2)]]


def _page_plan(alias: str, sql: str) -> str:
    with connections[alias].cursor() as cursor:
        if alias == "postgres":
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + sql)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


ALL_TABLES = ("stateentry", "checkpoint", "effect")


@pytest.mark.parametrize(
    ("query", "tables"),
    [
        ({"limit": 10, "after": "checkpoint:r5:5"}, ALL_TABLES),
        ({"limit": 10, "after": "effect:r2:50", "prefix": "effect:r2:"}, ("stateentry", "effect")),
        ({"limit": 10, "after": "k0500", "prefix": "k"}, ("stateentry",)),
        ({"limit": 10}, ALL_TABLES),
    ],
    ids=["deep", "deep-in-a-run", "plain", "first"],
)
def test_a_state_page_reads_limit_plus_one_rows_of_each_table_through_its_index(api, alice, alias, query, tables):
    """Deep in a long thread, a page walks each table's (thread, key) index from ``after``:
    no scan or sort of the thread's checkpoints (their columns' order is not their keys')."""
    thread = models.Thread.objects.using(alias).create(owner=alice, thread_id="long")
    every = [(f"r{run}", step) for run in range(10) for step in range(1000)]
    models.Checkpoint.objects.using(alias).bulk_create(
        [models.Checkpoint(thread=thread, run_id=run, step=step, phase="p", value=step) for run, step in every],
        batch_size=2000,
    )
    models.Effect.objects.using(alias).bulk_create(
        [models.Effect(thread=thread, run_id=run, step=step, tool_call_id="c", value=step) for run, step in every],
        batch_size=2000,
    )
    models.StateEntry.objects.using(alias).bulk_create(
        [models.StateEntry(thread=thread, key=f"k{i:04}", value=i) for i in range(2000)], batch_size=2000
    )
    with connections[alias].cursor() as cursor:
        for model in (models.Checkpoint, models.Effect, models.StateEntry, models.Thread):
            cursor.execute(f"ANALYZE {model._meta.db_table}")
    with CaptureQueriesContext(connections[alias]) as captured:
        response = api.get(url("threads", "long", "state", **query))
    assert response.status_code == 200 and len(response.json()["state"]) == 10
    [sql] = [q["sql"] for q in captured.captured_queries if "afkmemory_stateentry" in q["sql"]]
    plan = _page_plan(alias, sql)
    if alias == "postgres":
        assert not re.search(r"Seq Scan on afkmemory_(stateentry|checkpoint|effect)", plan), plan
        assert "Sort" not in plan, plan
        scans = re.findall(r"Index Scan using afkmemory_(\w+?)_(?:key|uniq) on \w+ \(actual rows=(\d+)", plan)
        assert sorted(name for name, _ in scans) == sorted(tables), plan
        assert all(int(rows) <= 11 for _, rows in scans), plan  # limit + 1 at most, however deep
    else:
        assert "TEMP B-TREE" not in plan and "SCAN afkmemory" not in plan, plan  # no sort, no scan
        searched = re.findall(r"SEARCH afkmemory_(\w+) USING INDEX \w+ \(thread_id=\?([^)]*)\)", plan)
        assert sorted(name for name, _ in searched) == sorted(tables), plan
        if "after" in query:  # a range of the index, from there
            assert all(">?" in bounds for _, bounds in searched), plan


# -- checkpoints --------------------------------------------------------------------------------


def checkpoint(client, thread_id: str, run_id: str, step: int, phase: str, payload) -> dict:
    body = {"run_id": run_id, "step": step, "phase": phase, "payload": payload}
    response = client.post(url("threads", thread_id, "checkpoints"), body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def test_checkpoints_list_and_latest(api):
    first = checkpoint(api, "t", "run-1", 0, "pre_llm", {"n": 0})
    assert first["key"] == "checkpoint:run-1:0:pre_llm" and first["payload"] == {"n": 0}
    checkpoint(api, "t", "run-1", 1, "step_end", {"n": 1})
    checkpoint(api, "t", "run-1", 10, "pre_llm", {"n": 10})  # step order is numeric, not textual
    checkpoint(api, "t", "run-2", 5, "pre_llm", {"other": True})

    listed = api.get(url("threads", "t", "checkpoints", run_id="run-1"))
    assert listed.status_code == 200
    assert [(c["step"], c["payload"]) for c in listed.json()["checkpoints"]] == [
        (0, {"n": 0}),
        (1, {"n": 1}),
        (10, {"n": 10}),
    ]

    latest = api.get(url("threads", "t", "checkpoints", "latest", run_id="run-1"))
    assert latest.status_code == 200 and latest.json()["step"] == 10 and latest.json()["payload"] == {"n": 10}
    # Checkpoints are state keys: the pointer and the checkpoint are readable as state.
    pointer = api.get(state_url("t", "checkpoint:run-1:latest")).json()["value"]
    assert pointer["key"] == "checkpoint:run-1:10:pre_llm"

    assert api.get(url("threads", "t", "checkpoints", run_id="run-3")).json() == {"checkpoints": [], "next": None}
    assert api.get(url("threads", "t", "checkpoints", "latest", run_id="run-3")).status_code == 404
    assert api.get(url("threads", "missing", "checkpoints", run_id="run-1")).status_code == 404


def long_runs(owner, alias: str, thread_id: str = "t") -> SyncDjangoMemoryStore:
    """Runs whose ids share a beginning, with steps whose text order is not their number's."""
    store = awkward_state(owner, alias, thread_id)  # runs a, a-1, a0, b: pre_llm at seven steps
    for step in (0, 1, 2, 9, 10, 11, 100):
        for phase in ("step_end", "post_llm", "Z", "é"):  # written out of their code point order
            store.write_checkpoint(thread_id, "a", step, phase, {"step": step, "phase": phase})
    return store


def walk_checkpoints(client, run_id: str, thread_id: str = "t", **query) -> list[list[dict]]:
    """Return the pages of a run's checkpoints, following ``next`` from the first."""
    pages = []
    response = client.get(url("threads", thread_id, "checkpoints", run_id=run_id, **query))
    while True:
        assert response.status_code == 200, response.json()
        body = response.json()
        assert list(body) == ["checkpoints", "next"]
        pages.append(body["checkpoints"])
        if body["next"] is None:
            return pages
        response = client.get(body["next"])


@pytest.mark.parametrize("run_id", ["a", "a-1", "b", "none"])
@pytest.mark.parametrize("limit", [1, 4, None])
def test_checkpoint_pages_walk_the_run_by_step_then_phase(api, alice, alias, run_id, limit):
    """Following next gives every checkpoint of the run once, ordered by step (a number) and
    then phase (code points), in full pages but the last; none of another run or a plain key."""
    store = long_runs(alice, alias)
    pages = walk_checkpoints(api, run_id, **({} if limit is None else {"limit": limit}))
    expected = sorted(store.list_checkpoints("t", run_id), key=lambda c: (c.step, c.phase))
    assert [(c["step"], c["phase"], c["payload"]) for page in pages for c in page] == [
        (c.step, c.phase, c.payload) for c in expected
    ]
    assert all(
        c["run_id"] == run_id and c["key"] == f"checkpoint:{run_id}:{c['step']}:{c['phase']}" for p in pages for c in p
    )
    size = limit or 100
    assert all(len(page) == size for page in pages[:-1]), [len(page) for page in pages]
    assert len(pages) == max(1, -(-len(expected) // size))
    if run_id == "a":
        assert len(expected) == 35
        assert [(c.step, c.phase) for c in expected[:5]] == [
            (0, "Z"),
            (0, "post_llm"),
            (0, "pre_llm"),
            (0, "step_end"),
            (0, "é"),
        ]


def test_a_checkpoint_page_starts_after_any_step_and_phase_and_keeps_the_query(api, alice, alias):
    long_runs(alice, alias)
    body = api.get(url("threads", "t", "checkpoints", run_id="a", after="9:q", limit=3)).json()  # no such phase
    assert [(c["step"], c["phase"]) for c in body["checkpoints"]] == [(9, "step_end"), (9, "é"), (10, "Z")]
    assert parse_qs(urlsplit(body["next"]).query) == {"run_id": ["a"], "after": ["10:Z"], "limit": ["3"]}
    body = api.get(url("threads", "t", "checkpoints", run_id="a", after="5:zzz")).json()  # no such step
    assert [c["step"] for c in body["checkpoints"]][:1] == [9] and body["next"] is None
    assert api.get(url("threads", "t", "checkpoints", run_id="a", after="100:é")).json() == {
        "checkpoints": [],
        "next": None,
    }
    # An empty after is no after.
    assert len(api.get(url("threads", "t", "checkpoints", run_id="a", after="")).json()["checkpoints"]) == 35


def test_checkpoint_page_limits(api, alice, alias, settings):
    store = SyncDjangoMemoryStore(owner=alice, using=alias)
    for step in range(101):
        store.write_checkpoint("t", "r", step, "p", step)
    first = api.get(url("threads", "t", "checkpoints", run_id="r")).json()
    assert [c["step"] for c in first["checkpoints"]] == list(range(100))  # the default page: 100
    last = api.get(first["next"]).json()
    assert [c["step"] for c in last["checkpoints"]] == [100] and last["next"] is None
    assert len(api.get(url("threads", "t", "checkpoints", run_id="r", limit=500)).json()["checkpoints"]) == 101
    assert "limit" in errors(api.get(url("threads", "t", "checkpoints", run_id="r", limit=501)))
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_PAGE_SIZE": 5}
    assert len(api.get(url("threads", "t", "checkpoints", run_id="r")).json()["checkpoints"]) == 5


@pytest.mark.parametrize(
    "after",
    [
        "x",
        "1",
        "1:",
        ":p",
        "-1:p",
        "+1:p",
        " 1:p",
        "\uff11:p",
        "1.5:p",
        "9223372036854775808:p",
        "1:nul\x00",
        "1:" + "p" * 300,
    ],
)
def test_bad_checkpoint_page_cursors_answer_400(api, alias, after):
    checkpoint(api, "t", "r", 1, "p", None)
    assert "after" in errors(api.get(url("threads", "t", "checkpoints", run_id="r", after=after)))
    assert "after" in errors(api.get(url("threads", "missing", "checkpoints", run_id="r", after=after)))


def test_checkpoint_page_refuses_bad_arguments(alice, alias):
    store = SyncDjangoMemoryStore(owner=alice, using=alias)
    with pytest.raises(ValueError, match="limit"):
        store.checkpoint_page("t", "r", limit=0)
    with pytest.raises(ValueError, match="run_id"):
        store.checkpoint_page("t", "a:b")
    with pytest.raises(TypeError, match="after step"):
        store.checkpoint_page("t", "r", ("1", "p"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="after phase"):
        store.checkpoint_page("t", "r", (1, ""))
    assert store.checkpoint_page("missing", "r") == ([], None)


def test_a_deep_checkpoint_page_reads_limit_plus_one_rows_through_the_unique_index(api, alice, alias):
    """Deep in a long run, a page walks the (thread, run, step, phase) index from ``after``:
    no scan and no sort of the run's checkpoints."""
    thread = models.Thread.objects.using(alias).create(owner=alice, thread_id="long")
    models.Checkpoint.objects.using(alias).bulk_create(
        [
            models.Checkpoint(thread=thread, run_id=f"r{run}", step=step, phase=phase, value=step)
            for run in range(3)
            for step in range(3000)
            for phase in ("a", "b")
        ],
        batch_size=2000,
    )
    with connections[alias].cursor() as cursor:
        for model in (models.Checkpoint, models.Thread):
            cursor.execute(f"ANALYZE {model._meta.db_table}")
    with CaptureQueriesContext(connections[alias]) as captured:
        response = api.get(url("threads", "long", "checkpoints", run_id="r1", after="2500:a", limit=10))
    assert [(c["step"], c["phase"]) for c in response.json()["checkpoints"]][:3] == [
        (2500, "b"),
        (2501, "a"),
        (2501, "b"),
    ]
    [sql] = [q["sql"] for q in captured.captured_queries if "afkmemory_checkpoint" in q["sql"]]
    plan = _page_plan(alias, sql)
    if alias == "postgres":
        assert not re.search(r"Seq Scan on afkmemory_checkpoint", plan) and "Sort" not in plan, plan
        [rows] = re.findall(r"Index Scan using afkmemory_checkpoint_uniq on \w+ \(actual rows=(\d+)", plan)
        assert int(rows) <= 11, plan  # limit + 1, however deep
    else:
        assert "TEMP B-TREE" not in plan and "SCAN afkmemory_checkpoint" not in plan, plan
        assert re.search(
            r"SEARCH afkmemory_checkpoint USING INDEX \w+ \(thread_id=\? AND run_id=\? AND step>\?\)", plan
        ), plan


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"run_id": "a:b", "step": 0, "phase": "p", "payload": 1}, "run_id"),
        ({"run_id": "r", "step": -1, "phase": "p", "payload": 1}, "step"),
        ({"run_id": "r", "step": "1", "phase": "p", "payload": 1}, "step"),
        ({"run_id": "r", "step": 1, "phase": "", "payload": 1}, "phase"),
        ({"run_id": "r", "step": 1, "phase": "p"}, "payload"),
    ],
)
def test_bad_checkpoints_are_refused(api, alias, body, field):
    assert field in errors(api.post(url("threads", "t", "checkpoints"), body, format="json"))
    assert not models.Checkpoint.objects.using(alias).exists()


def test_checkpoint_queries_need_a_valid_run_id(api):
    checkpoint(api, "t", "run-1", 0, "pre_llm", None)
    assert "run_id" in errors(api.get(url("threads", "t", "checkpoints")))
    assert "run_id" in errors(api.get(url("threads", "t", "checkpoints", "latest", run_id="a:b")))


def test_checkpoints_of_another_tenant_answer_404(api, other):
    checkpoint(api, "t", "run-1", 0, "pre_llm", {"secret": 1})
    assert other.get(url("threads", "t", "checkpoints", run_id="run-1")).status_code == 404
    assert other.get(url("threads", "t", "checkpoints", "latest", run_id="run-1")).status_code == 404
    checkpoint(other, "t", "run-1", 3, "step_end", {"bob": 1})
    assert api.get(url("threads", "t", "checkpoints", "latest", run_id="run-1")).json()["payload"] == {"secret": 1}
    assert [c["step"] for c in other.get(url("threads", "t", "checkpoints", run_id="run-1")).json()["checkpoints"]] == [
        3
    ]


def test_reading_a_state_key_is_one_query(api, alias):
    put(api, "t", "plan", {"step": 1})
    with CaptureQueriesContext(connections[alias]) as captured:
        assert api.get(state_url("t", "plan")).status_code == 200
    assert len(captured.captured_queries) == 1, [q["sql"] for q in captured.captured_queries]
    assert api.get(state_url("t", "absent")).status_code == 404
    assert api.get(state_url("no-such-thread", "plan")).status_code == 404
