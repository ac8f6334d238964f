"""The admin: every changelist renders with data, memories are editable and stay searchable."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from afkmemory import models
from afkmemory.memory import LongTermMemory, MemoryEvent
from afkmemory.stores import SyncDjangoMemoryStore

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client):
    user = get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
    client.force_login(user)
    return client


@pytest.fixture
def filled():
    store = SyncDjangoMemoryStore()
    store.append_event(MemoryEvent("e1", "thread-1", "u1", "message", 1, {"text": "hi"}, []))
    store.put_state("thread-1", "plan", {"step": 1})
    store.put_state("thread-1", "checkpoint:run-1:0:pre_llm", {"payload": {}})
    store.put_state("thread-1", "effect:run-1:0:call-1", {"input_hash": "h", "output": 1})
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="likes tea"), embedding=[1.0] * 8)
    models.GraphCheckpoint.objects.create(thread=models.Thread.objects.get(), step=0, payload={})
    return store


@pytest.mark.parametrize(
    "model", ["thread", "event", "stateentry", "checkpoint", "effect", "graphcheckpoint", "longtermmemory", "storeitem"]
)
def test_changelists_and_change_pages_render(staff_client, filled, model):
    response = staff_client.get(reverse(f"admin:afkmemory_{model}_changelist"))
    assert response.status_code == 200
    obj = getattr(models, response.context["cl"].model.__name__).objects.first()
    if obj is not None:
        assert staff_client.get(reverse(f"admin:afkmemory_{model}_change", args=[obj.pk])).status_code == 200


def test_editing_a_memory_keeps_it_searchable(staff_client, filled):
    memory = models.LongTermMemory.objects.get(memory_id="m1")
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    response = staff_client.post(url, {
        "owner": "", "memory_id": "m1", "user_id": "u1", "scope": "global", "text": "prefers green coffee",
        "data": "{}", "tags": "[]", "metadata": "{}",
    })  # fmt: skip
    assert response.status_code == 302, response.content
    assert [m.id for m in filled.search_long_term_memory_text("u1", "coffee")] == ["m1"]
    assert filled.search_long_term_memory_text("u1", "tea") == []
    memory.refresh_from_db()
    assert memory.embedding is not None  # the embedding survives an edit of the text
    assert memory.updated_at > 1000


def test_thread_links_to_its_records(staff_client, filled):
    response = staff_client.get(reverse("admin:afkmemory_thread_changelist"))
    thread = models.Thread.objects.get()
    assert f"?thread__id__exact={thread.pk}".encode() in response.content
    events = staff_client.get(reverse("admin:afkmemory_event_changelist") + f"?thread__id__exact={thread.pk}")
    assert b"e1" in events.content
