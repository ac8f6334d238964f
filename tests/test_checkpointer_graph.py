"""An agentflow graph on afkmemory alone: it checkpoints through DjangoCheckpointer, stops, and resumes."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from agentflow import END, START, Graph, State
from agentflow.errors import NodeError
from agentflow.state import append

from afkmemory.models import GraphCheckpoint
from afkmemory.stores import DjangoCheckpointer, DjangoStore
from tests.utils import in_processes, run

ALIASES = ["default", "postgres"]


class Article(State):
    topic: str
    user: str
    log: Annotated[list, append]
    approved: bool


def build(alias: str, *, fail_publish_once: dict[str, bool] | None = None) -> Any:
    """draft -> review (asks a human) -> publish; memory of past topics lives in a DjangoStore."""
    store = DjangoStore(using=alias)

    async def draft(state: dict, ctx: Any) -> dict:
        last = await store.get(("users", state["user"]), "last_topic")
        return {"log": [f"draft {state['topic']} (last: {last.value if last else None})"]}

    async def review(state: dict, ctx: Any) -> dict:
        answer = await ctx.interrupt({"type": "clarification", "question": f"Publish {state['topic']}?"})
        return {"approved": answer == "yes", "log": [f"review: {answer}"]}

    async def publish(state: dict, ctx: Any) -> dict:
        if fail_publish_once is not None and not fail_publish_once.get("failed"):
            fail_publish_once["failed"] = True
            raise ConnectionError("the publishing service is down")
        await store.put(("users", state["user"]), "last_topic", state["topic"])
        return {"log": ["published" if state["approved"] else "discarded"]}

    graph = Graph(Article)
    graph.add_node("draft", draft).add_node("review", review).add_node("publish", publish)
    graph.add_edge(START, "draft").add_edge("draft", "review").add_edge("review", "publish").add_edge("publish", END)
    return graph.compile(checkpointer=DjangoCheckpointer(using=alias))


def start_until_review(alias: str, thread: str) -> dict:
    """Run the graph in this (separate) process until it stops for the human review."""
    return run(build(alias).invoke({"topic": "cats", "user": "u1", "log": []}, thread=thread))


@pytest.mark.slow
@pytest.mark.django_db(databases=ALIASES, transaction=True)
@pytest.mark.parametrize("alias", ALIASES)
def test_a_run_interrupted_in_one_process_resumes_in_another(alias):
    [state] = in_processes(start_until_review, [(alias, "run-1")])
    assert state["log"] == ["draft cats (last: None)"]

    graph = build(alias)  # nothing carried over in memory: only the database
    stopped = run(graph.get_state("run-1"))
    assert (stopped.interrupted, stopped.interrupt_node, stopped.next) == (True, "review", ("review",))
    assert stopped.interrupt_payload == {"type": "clarification", "question": "Publish cats?"}
    assert [(t.thread, t.interrupted, t.done) for t in run(graph.checkpointer.list_threads())] == [
        ("run-1", True, False)
    ]

    final = run(graph.resume("run-1", "yes"))
    assert final["log"] == ["draft cats (last: None)", "review: yes", "published"]
    assert run(graph.get_state("run-1")).done

    async def steps() -> list[tuple[int, bool]]:
        return [(cp.step, cp.interrupted) async for cp in graph.history("run-1")]

    assert run(steps()) == [(1, False), (2, True), (3, False), (4, False)]

    # A new run, in another thread, remembers what the first one stored.
    second = run(graph.invoke({"topic": "dogs", "user": "u1", "log": []}, thread="run-2"))
    assert second["log"] == ["draft dogs (last: cats)"]


@pytest.mark.django_db(databases=ALIASES)
@pytest.mark.parametrize("alias", ALIASES)
def test_a_run_that_crashed_resumes_from_its_last_checkpoint(alias):
    failures: dict[str, bool] = {}
    graph = build(alias, fail_publish_once=failures)
    run(graph.invoke({"topic": "cats", "user": "u1", "log": []}, thread="run-1"))
    with pytest.raises(NodeError, match="publishing service is down"):
        run(graph.resume("run-1", "no"))
    last = run(graph.get_state("run-1"))
    assert (last.step, last.next, last.interrupted) == (3, ("publish",), False)  # review's step was saved
    assert last.state["log"] == ["draft cats (last: None)", "review: no"]

    final = run(build(alias, fail_publish_once=failures).resume("run-1"))
    assert final["log"] == ["draft cats (last: None)", "review: no", "discarded"]
    assert GraphCheckpoint.objects.using(alias).count() == 4
    assert run(graph.checkpointer.prune("run-1", before_step=4)) == 3
    assert [t.latest_step for t in run(graph.checkpointer.list_threads())] == [4]
