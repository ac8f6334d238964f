"""What staff can save through the admin's forms, on SQLite and PostgreSQL: what the stores
and the API would take, found by the stores' reads and searches afterwards; a refusal is a
form error, never a 500."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from django.urls import reverse

from afkmemory import models
from afkmemory.memory import LongTermMemory, MemoryEvent
from afkmemory.stores import SyncDjangoMemoryStore, SyncDjangoStore

pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


class AllToPostgres:
    """Every model (accounts and sessions too) read and written on PostgreSQL."""

    def db_for_read(self, model, **hints):
        return "postgres"

    def db_for_write(self, model, **hints):
        return "postgres"

    def allow_relation(self, a, b, **hints):
        return True


@pytest.fixture(params=["default", "postgres"])
def on(request):
    """(alias, staff client) with the admin reading and writing ``alias``; the client returns 500s."""
    alias = request.param
    routers = [f"{__name__}.AllToPostgres"] if alias == "postgres" else []
    with override_settings(DATABASE_ROUTERS=routers):
        staff = get_user_model().objects.create_superuser("admin", "a@example.com", "pw")
        client = Client(raise_request_exception=False)
        client.force_login(staff)
        yield alias, client


def _users(*names):
    return [get_user_model().objects.create_user(name) for name in names]


def _memory_form(**changes) -> dict:
    return {"owner": "", "memory_id": "m1", "user_id": "u1", "scope": "global", "text": "likes tea",
            "data": "{}", "tags": "[]", "metadata": "{}", **changes}  # fmt: skip


def _item_form(**changes) -> dict:
    return {"owner": "", "key": "k", "value": "1", "expires_at_0": "", "expires_at_1": "", **changes}


def _form_errors(response) -> dict:
    assert response.status_code == 200, f"expected the form again with an error, got HTTP {response.status_code}"
    return response.context["adminform"].form.errors


# -- a duplicate of a constraint whose fields the form does not edit (was an IntegrityError, a 500) --


def test_a_memory_moved_to_an_account_that_has_its_id_is_a_form_error(on):
    alias, client = on
    a, b = _users("a", "b")
    for owner in (a, b):
        SyncDjangoMemoryStore(owner=owner, using=alias).upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
    memory = models.LongTermMemory.objects.using(alias).get(owner=a)
    response = client.post(
        reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk]), _memory_form(owner=str(b.pk))
    )
    assert _form_errors(response)
    assert models.LongTermMemory.objects.using(alias).get(pk=memory.pk).owner_id == a.pk


def test_a_thread_moved_to_an_account_that_has_its_id_is_a_form_error(on):
    alias, client = on
    a, b = _users("a", "b")
    for owner in (a, b):
        SyncDjangoMemoryStore(owner=owner, using=alias).put_state("t1", "k", 1)
    thread = models.Thread.objects.using(alias).get(owner=a)
    response = client.post(
        reverse("admin:afkmemory_thread_change", args=[thread.pk]), {"owner": str(b.pk), "metadata": "{}"}
    )
    assert _form_errors(response)


@pytest.mark.parametrize("ttl", [None, 0], ids=["live", "expired"])
def test_a_store_item_renamed_onto_a_taken_key_is_a_form_error(on, ttl):
    alias, client = on
    store = SyncDjangoStore(using=alias)
    store.put(("ns",), "k1", 1, ttl=ttl)
    store.put(("ns",), "k2", 2)
    item = models.StoreItem.objects.using(alias).get(key="k2")
    response = client.post(reverse("admin:afkmemory_storeitem_change", args=[item.pk]), _item_form(key="k1"))
    assert "key" in _form_errors(response) or _form_errors(response)


def test_a_store_item_moved_to_an_account_that_has_its_key_is_a_form_error(on):
    alias, client = on
    a, b = _users("a", "b")
    for owner in (a, b):
        SyncDjangoStore(owner=owner, using=alias).put(("ns",), "k", 1)
    item = models.StoreItem.objects.using(alias).get(owner=a)
    response = client.post(reverse("admin:afkmemory_storeitem_change", args=[item.pk]), _item_form(owner=str(b.pk)))
    assert _form_errors(response)


# -- silent changes and unparsable input --------------------------------------------------------


def test_editing_a_memory_keeps_its_null_text_null(on):
    """AFK tells None from "": an admin save of a text-less memory (here only its tags change)
    stored "", and the API then returned text "" instead of null."""
    alias, client = on
    store = SyncDjangoMemoryStore(using=alias)
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text=None, data={"k": "v"}))
    memory = models.LongTermMemory.objects.using(alias).get()
    response = client.post(
        reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk]),
        _memory_form(text="", data='{"k": "v"}', tags='["new"]'),
    )
    assert response.status_code == 302
    [listed] = store.list_long_term_memories("u1")
    assert listed.tags == ["new"]
    assert listed.text is None, f"text became {listed.text!r}"


def test_a_memory_added_without_text_has_null_text(on):
    """The API's default text is null; the admin's add form stored ""."""
    alias, client = on
    assert client.post(reverse("admin:afkmemory_longtermmemory_add"), _memory_form(text="")).status_code == 302
    [listed] = SyncDjangoMemoryStore(using=alias).list_long_term_memories("u1")
    assert listed.text is None, f"text is {listed.text!r}"


@pytest.mark.parametrize("field", ["data", "metadata", "tags"])
def test_json_nested_past_the_parser_is_a_form_error(on, field):
    """Django's forms.JSONField catches JSONDecodeError only: json.loads' RecursionError was a 500."""
    alias, client = on
    SyncDjangoMemoryStore(using=alias).upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
    memory = models.LongTermMemory.objects.using(alias).get()
    deep = "[" * 100_000 + "]" * 100_000
    response = client.post(
        reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk]), _memory_form(**{field: deep})
    )
    assert field in _form_errors(response)


def test_json_nested_past_the_parser_in_a_store_item_is_a_form_error(on):
    alias, client = on
    SyncDjangoStore(using=alias).put(("ns",), "k", 1)
    item = models.StoreItem.objects.using(alias).get()
    deep = "[" * 100_000 + "]" * 100_000
    response = client.post(reverse("admin:afkmemory_storeitem_change", args=[item.pk]), _item_form(value=deep))
    assert "value" in _form_errors(response)


# -- edits the stores read back -------------------------------------------------------------------


def test_an_edited_memory_is_found_by_its_new_words_only_and_keeps_its_embedding(on):
    alias, client = on
    store = SyncDjangoMemoryStore(using=alias)
    store.upsert_long_term_memory(LongTermMemory("m1", "u1", text="likes tea", tags=["drink"]), embedding=[1.0] * 8)
    memory = models.LongTermMemory.objects.using(alias).get()
    before = memory.updated_at
    response = client.post(
        reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk]),
        _memory_form(text="prefers coffee", tags='["beverage"]', data='{"origin": "kenya"}'),
    )
    assert response.status_code == 302
    search = store.search_long_term_memory_text
    assert [m.id for m in search("u1", "coffee")] == ["m1"]
    assert [m.id for m in search("u1", "beverage kenya")] == ["m1"]
    assert search("u1", "tea") == [] and search("u1", "drink") == []
    memory.refresh_from_db()
    assert memory.updated_at >= before and memory.embedding is not None and len(memory.embedding) == 8
    assert [m.id for m, _ in store.search_long_term_memory_vector("u1", [1.0] * 8)] == ["m1"]


def test_a_memory_added_in_the_admin_is_listed_and_text_searchable(on):
    alias, client = on
    owner = _users("a")[0]
    form = _memory_form(owner=str(owner.pk), text="walks the dog", tags='["pets"]')
    assert client.post(reverse("admin:afkmemory_longtermmemory_add"), form).status_code == 302
    store = SyncDjangoMemoryStore(owner=owner, using=alias)
    [listed] = store.list_long_term_memories("u1")
    assert listed.id == "m1" and listed.created_at == listed.updated_at > 0
    assert [m.id for m in store.search_long_term_memory_text("u1", "dog")] == ["m1"]
    assert [m.id for m in store.search_long_term_memory_text("u1", "pets")] == ["m1"]
    assert store.search_long_term_memory_vector("u1", [1.0] * 8) == []  # no embedding: the admin cannot set one
    # The same id again for the same owner: a form error, not a 500.
    assert "__all__" in _form_errors(client.post(reverse("admin:afkmemory_longtermmemory_add"), form))


def test_the_embedding_is_not_a_form_field(on):
    alias, client = on
    SyncDjangoMemoryStore(using=alias).upsert_long_term_memory(LongTermMemory("m1", "u1"), embedding=[1.0] * 8)
    memory = models.LongTermMemory.objects.using(alias).get()
    url = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    assert client.post(url, _memory_form(embedding="[NaN, 1]")).status_code == 302
    memory.refresh_from_db()
    assert list(memory.embedding) == [1.0] * 8


def test_a_thread_added_twice_is_a_form_error_and_a_moved_thread_takes_its_records(on):
    alias, client = on
    a, b = _users("a", "b")
    add = reverse("admin:afkmemory_thread_add")
    assert client.post(add, {"owner": str(a.pk), "thread_id": "t1", "metadata": "{}"}).status_code == 302
    assert _form_errors(client.post(add, {"owner": str(a.pk), "thread_id": "t1", "metadata": "{}"}))
    SyncDjangoMemoryStore(owner=a, using=alias).append_event(MemoryEvent("e1", "t1", None, "message", 1, {}, []))
    thread = models.Thread.objects.using(alias).get()
    change = reverse("admin:afkmemory_thread_change", args=[thread.pk])
    assert client.post(change, {"owner": str(b.pk), "metadata": "{}"}).status_code == 302
    assert [e.id for e in SyncDjangoMemoryStore(owner=b, using=alias).get_recent_events("t1")] == ["e1"]
    assert SyncDjangoMemoryStore(owner=a, using=alias).get_recent_events("t1") == []


def test_an_expired_item_is_revived_by_clearing_its_expiry(on):
    alias, client = on
    store = SyncDjangoStore(using=alias)
    store.put(("ns",), "k", 1, ttl=0)
    assert store.get(("ns",), "k") is None
    item = models.StoreItem.objects.using(alias).get()
    response = client.post(reverse("admin:afkmemory_storeitem_change", args=[item.pk]), _item_form(value='{"a": 2}'))
    assert response.status_code == 302
    assert store.get(("ns",), "k").value == {"a": 2}
    assert "value" in _form_errors(
        client.post(reverse("admin:afkmemory_storeitem_change", args=[item.pk]), _item_form(value="NaN"))
    )


def test_view_only_and_memory_only_staff_cannot_reach_further(client):
    owner = get_user_model().objects.create_user("o")
    SyncDjangoMemoryStore(owner=owner).upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
    SyncDjangoMemoryStore(owner=owner).append_event(MemoryEvent("e1", "t1", None, "message", 1, {}, []))
    memory = models.LongTermMemory.objects.get()
    viewer = get_user_model().objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename__in=["view_longtermmemory", "view_thread"]))
    client.force_login(viewer)
    change = reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk])
    assert client.get(change).status_code == 200
    assert client.post(change, _memory_form(text="changed")).status_code == 403
    assert models.LongTermMemory.objects.get().text == "tea"
    assert client.get(reverse("admin:auth_user_changelist") + "?_to_field=id&_popup=1").status_code == 403
    auto = reverse("admin:autocomplete")
    for model in ("longtermmemory", "thread", "storeitem"):
        query = {"app_label": "afkmemory", "model_name": model, "field_name": "owner", "term": "o"}
        assert client.get(auto, query).status_code == 403
    assert client.get(reverse("admin:afkmemory_event_changelist")).status_code == 403
    thread = models.Thread.objects.get()
    assert client.post(reverse("admin:afkmemory_thread_delete", args=[thread.pk]), {"post": "yes"}).status_code == 403
    # Lookups through a relation the admin does not offer are refused (no field probing via ?owner__password...).
    listed = client.get(reverse("admin:afkmemory_longtermmemory_changelist"), {"owner__password__startswith": "m"})
    assert listed.status_code in (302, 400)


SMALL_LIMIT = {"EMBEDDING_DIMENSIONS": 8, "EXACT_SEARCH_THRESHOLD": 200, "API_MAX_VALUE_BYTES": 64}


def test_the_admin_refuses_values_past_the_apis_size_limit(on):
    """A client that read such a memory and sent it back would get a 400."""
    alias, client = on
    big = "x" * 200
    with override_settings(AFKMEMORY=SMALL_LIMIT):
        SyncDjangoMemoryStore(using=alias).upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
        SyncDjangoStore(using=alias).put(("ns",), "k", 1)
        memory = models.LongTermMemory.objects.using(alias).get()
        item = models.StoreItem.objects.using(alias).get()
        memory_page = client.post(
            reverse("admin:afkmemory_longtermmemory_change", args=[memory.pk]),
            _memory_form(text=big, data=f'{{"k": "{big}"}}'),
        )
        item_url = reverse("admin:afkmemory_storeitem_change", args=[item.pk])
        item_page = client.post(item_url, _item_form(value=f'"{big}"'))
    saved = (models.LongTermMemory.objects.using(alias).get().text, models.StoreItem.objects.using(alias).get().value)
    assert memory_page.status_code == 200 and item_page.status_code == 200, f"saved: {[len(v) for v in saved]}"


# -- a run's latest checkpoint and its pointer ----------------------------------------------------


def _two_steps(alias: str) -> SyncDjangoMemoryStore:
    store = SyncDjangoMemoryStore(using=alias)
    store.write_checkpoint("t", "r", 0, "step_end", {"n": 0})
    store.write_checkpoint("t", "r", 1, "step_end", {"n": 1})
    return store


@pytest.mark.parametrize("what", ["checkpoint", "pointer"])
def test_a_runs_latest_checkpoint_and_its_pointer_are_not_deleted_one_by_one(on, what):
    """Deleting either left the run with checkpoints but no latest one: a resumed run started over."""
    alias, client = on
    store = _two_steps(alias)
    if what == "checkpoint":
        record = models.Checkpoint.objects.using(alias).get(step=1)
        url = reverse("admin:afkmemory_checkpoint_delete", args=[record.pk])
    else:
        record = models.StateEntry.objects.using(alias).get(key="checkpoint:r:latest")
        url = reverse("admin:afkmemory_stateentry_delete", args=[record.pk])
    assert client.post(url, {"post": "yes"}).status_code == 403
    assert store.latest_checkpoint("t", "r").step == 1
    older = models.Checkpoint.objects.using(alias).get(step=0)
    response = client.post(reverse("admin:afkmemory_checkpoint_delete", args=[older.pk]), {"post": "yes"})
    assert response.status_code == 302
    assert [c.step for c in store.list_checkpoints("t", "r")] == [1]


@pytest.mark.parametrize("model", ["checkpoint", "stateentry"])
def test_deleting_selected_records_keeps_a_runs_latest_checkpoint_and_its_pointer(on, model):
    alias, client = on
    store = _two_steps(alias)
    store.put_state("t", "plain", 1)
    rows = getattr(models, {"checkpoint": "Checkpoint", "stateentry": "StateEntry"}[model]).objects.using(alias)
    url = reverse(f"admin:afkmemory_{model}_changelist")
    chosen = {"action": "delete_selected", "_selected_action": [str(pk) for pk in rows.values_list("pk", flat=True)]}
    confirm = client.post(url, chosen)
    assert confirm.context["deletable_objects"] == [[f"1 {rows.model._meta.verbose_name}"]]  # of the two
    response = client.post(url, {**chosen, "post": "yes"}, follow=True)
    said = [str(message) for message in response.context["messages"]]
    assert said[0].startswith(f"1 {rows.model._meta.verbose_name} kept: a run's latest checkpoint and its pointer")
    assert said[1] == f"Successfully deleted 1 {rows.model._meta.verbose_name}."  # it said 2
    logged = LogEntry.objects.using(alias).filter(action_flag=DELETION).values_list("object_repr", flat=True)
    assert len(logged) == 1 and "latest" not in logged[0] and ":1:" not in logged[0]
    assert store.latest_checkpoint("t", "r").step == 1
    if model == "checkpoint":
        assert [c.step for c in store.list_checkpoints("t", "r")] == [1]
    else:
        assert store.get_state("t", "plain") is None


def test_staff_who_may_not_view_accounts_see_an_owners_id_not_its_name(client):
    """Django's raw id widget named the account beside its id, whatever the staff member may view."""
    secret = get_user_model().objects.create_user("secret-account-name")
    staff = get_user_model().objects.create_user("editor", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename__endswith="_longtermmemory"))
    client.force_login(staff)
    SyncDjangoMemoryStore(owner=secret).upsert_long_term_memory(LongTermMemory("m1", "u1", text="tea"))
    memory_url = reverse("admin:afkmemory_longtermmemory_change", args=[models.LongTermMemory.objects.get().pk])
    page = client.get(memory_url).content.decode()
    assert f'value="{secret.pk}"' in page and "secret-account-name" not in page
    staff.user_permissions.add(Permission.objects.get(codename="view_user"))
    assert "secret-account-name" in client.get(memory_url).content.decode()
