"""REST API: thread state and run checkpoints, on SQLite and PostgreSQL, with two tenants."""

from __future__ import annotations

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from afkmemory import models
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

    assert api.get(url("threads", "t", "checkpoints", run_id="run-3")).json() == {"checkpoints": []}
    assert api.get(url("threads", "t", "checkpoints", "latest", run_id="run-3")).status_code == 404
    assert api.get(url("threads", "missing", "checkpoints", run_id="run-1")).status_code == 404


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
