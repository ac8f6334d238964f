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


def _memory_form(**changes) -> dict:
    return {"owner": "", "memory_id": "m1", "user_id": "u1", "scope": "global", "text": "likes tea",
            "data": "{}", "tags": "[]", "metadata": "{}", **changes}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data", ""),  # empty: not null, not an object
        ("data", "[1]"),
        ("metadata", "5"),
        ("tags", ""),
        ("tags", '"abc"'),
        ("tags", "[1, 2]"),
        ("memory_id", "é" * 200),  # 200 characters, 400 bytes: past the stores' limit
    ],
)
def test_a_memory_the_stores_would_refuse_is_not_saved(staff_client, filled, field, value):
    memory = models.LongTermMemory.objects.get(memory_id="m1")
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    response = staff_client.post(url, _memory_form(**{field: value}))
    assert response.status_code == 200  # the form again, with the error
    assert field in response.context["adminform"].form.errors
    saved = models.LongTermMemory.objects.get(pk=memory.pk)
    assert (saved.data, saved.tags, saved.metadata, saved.memory_id) == ({}, [], {}, "m1")


@pytest.mark.parametrize("model", ["event", "stateentry", "checkpoint", "effect", "graphcheckpoint"])
def test_a_threads_records_are_browsed_and_deleted_not_edited(staff_client, filled, model):
    record = getattr(models, {"stateentry": "StateEntry", "graphcheckpoint": "GraphCheckpoint"}.get(
        model, model.capitalize()
    )).objects.first()  # fmt: skip
    change = reverse(f"admin:afkmemory_{model}_change", args=[record.pk])
    page = staff_client.get(change)
    assert page.status_code == 200 and not page.context["has_change_permission"]  # read-only view
    assert staff_client.post(change, {}).status_code == 403
    assert staff_client.get(reverse(f"admin:afkmemory_{model}_add")).status_code == 403
    delete = reverse(f"admin:afkmemory_{model}_delete", args=[record.pk])
    assert staff_client.post(delete, {"post": "yes"}).status_code == 302
    assert not type(record).objects.filter(pk=record.pk).exists()


def test_a_thread_is_added_with_an_id_the_api_can_name_and_never_renamed(staff_client, filled):
    add = reverse("admin:afkmemory_thread_add")
    for unnamable in ("a/b", ".."):
        refused = staff_client.post(add, {"owner": "", "thread_id": unnamable, "metadata": "{}"})
        assert "thread_id" in refused.context["adminform"].form.errors
    assert (
        "metadata"
        in staff_client.post(add, {"owner": "", "thread_id": "t2", "metadata": ""}).context["adminform"].form.errors
    )
    assert staff_client.post(add, {"owner": "", "thread_id": "t2", "metadata": '{"a": 1}'}).status_code == 302
    thread = models.Thread.objects.get(thread_id="thread-1")
    change = reverse("admin:afkmemory_thread_change", args=[thread.pk])
    assert staff_client.post(change, {"owner": "", "thread_id": "renamed", "metadata": '{"b": 2}'}).status_code == 302
    thread.refresh_from_db()
    assert (thread.thread_id, thread.metadata) == ("thread-1", {"b": 2})  # the id is read-only


def test_a_store_item_key_past_the_stores_limit_is_not_saved(staff_client):
    from afkmemory.stores import SyncDjangoStore

    SyncDjangoStore().put(("ns",), "k", 1)
    item = models.StoreItem.objects.get()
    change = reverse("admin:afkmemory_storeitem_change", args=[item.pk])
    response = staff_client.post(
        change, {"owner": "", "key": "é" * 600, "value": "1", "expires_at_0": "", "expires_at_1": ""}
    )
    assert "key" in response.context["adminform"].form.errors
    assert models.StoreItem.objects.get().key == "k"


def test_the_memory_list_says_which_have_an_embedding(staff_client, filled):
    filled.upsert_long_term_memory(LongTermMemory("m2", "u1", text="no vector"))
    page = staff_client.get(reverse("admin:afkmemory_longtermmemory_changelist"))
    rows = {memory.memory_id: memory.embedded for memory in page.context["cl"].result_list}
    assert rows == {"m1": True, "m2": False}
    assert page.content.count(b'alt="True"') == 1 and page.content.count(b'alt="False"') == 1
