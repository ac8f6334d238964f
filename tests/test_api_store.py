"""REST API: agentflow's store (items, claims, search, namespaces), on SQLite and PostgreSQL, with two tenants."""

from __future__ import annotations

import pytest

from afkmemory import models
from tests.api_helpers import errors, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])

ITEMS = url("store", "items")


def at(namespace: list[str], key: str) -> str:
    """Return the item's URL: ``namespace`` repeated once per segment, so any character survives."""
    return url("store", "items", namespace=namespace, key=key)


def put(client, namespace: list[str], key: str, value, **options):
    return client.put(ITEMS, {"namespace": namespace, "key": key, "value": value, **options}, format="json")


def test_put_get_delete(api):
    created = put(api, ["users", "u1"], "prefs", {"theme": "dark"})
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["namespace"] == ["users", "u1"] and body["value"] == {"theme": "dark"} and body["expires_at"] is None
    updated = put(api, ["users", "u1"], "prefs", {"theme": "light"})
    assert updated.status_code == 200 and updated.json()["created_at"] == body["created_at"]

    got = api.get(at(["users", "u1"], "prefs"))
    assert got.status_code == 200 and got.json()["value"] == {"theme": "light"}
    assert api.get(at(["users"], "prefs")).status_code == 404  # a prefix is another namespace
    assert api.delete(at(["users", "u1"], "prefs")).status_code == 204
    assert api.get(at(["users", "u1"], "prefs")).status_code == 404
    assert api.delete(at(["users", "u1"], "prefs")).status_code == 404


def test_a_put_says_created_or_replaced_as_the_statement_decided_not_by_timestamps(api, monkeypatch):
    """The 201 compared created_at with updated_at: two processes' puts of one new key stamped
    in the same microsecond both answered 201 (over HTTP, 1 round in 20). An expired item is
    absent, so a put over it creates."""
    from datetime import UTC, datetime

    from afkmemory.stores import items

    instant = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    monkeypatch.setattr(items.timezone, "now", lambda: instant)
    assert put(api, ["n"], "k", 1).status_code == 201
    replaced = put(api, ["n"], "k", 2)
    assert (replaced.status_code, replaced.json()["value"]) == (200, 2)
    monkeypatch.undo()
    assert put(api, ["n"], "gone", 1, ttl=0).status_code == 201
    assert put(api, ["n"], "gone", 2).status_code == 201


def test_any_character_survives_the_query_string(api):
    namespace = ["a.b", "50%_&x=y", "?#/ ü"]
    assert put(api, namespace, "k&=?", [1, None]).status_code == 201
    assert api.get(at(namespace, "k&=?")).json()["value"] == [1, None]
    assert api.get(at(["a.b", "50%_&x=y"], "k&=?")).status_code == 404
    assert api.get(at(["a", "b", "50%_&x=y", "?#/ ü"], "k&=?")).status_code == 404


def test_ttl_and_the_if_absent_claim(api):
    assert put(api, ["jobs"], "j1", "mine", if_absent=True).status_code == 201
    lost = put(api, ["jobs"], "j1", "theirs", if_absent=True)
    assert lost.status_code == 409 and "claim" in lost.json()["detail"]
    assert api.get(at(["jobs"], "j1")).json()["value"] == "mine"  # the loser wrote nothing
    # An expired item counts as absent: its key can be claimed again.
    assert put(api, ["jobs"], "j2", "old", ttl=0).status_code == 201
    assert api.get(at(["jobs"], "j2")).status_code == 404
    assert put(api, ["jobs"], "j2", "new", if_absent=True).status_code == 201
    timed = put(api, ["jobs"], "j3", 1, ttl=60).json()
    assert timed["expires_at"] is not None and timed["expires_at"] > timed["created_at"]


def test_the_search_route_answers_only_its_post(api, alias):
    """The view's item write was a method named ``put``, which DRF's dispatch finds on any route
    of the view: a PUT to the search route wrote an item (found by schemathesis)."""
    search = url("store", "items", "search")
    response = api.put(search, {"namespace": ["viasearch"], "key": "k", "value": 1}, format="json")
    assert response.status_code == 405, response.json()
    assert api.options(search)["Allow"] == "POST"
    assert api.options(ITEMS)["Allow"] == "GET, PUT, DELETE, HEAD"
    assert not models.StoreItem.objects.using(alias).exists()


def test_search_and_namespaces(api):
    for namespace, key in [(["a"], "1"), (["a", "b"], "2"), (["a", "b"], "3"), (["ab"], "4"), (["c"], "5")]:
        assert put(api, namespace, key, key).status_code == 201
    search = url("store", "items", "search")

    def keys(body) -> list[str]:
        response = api.post(search, body, format="json")
        assert response.status_code == 200, response.json()
        return [item["key"] for item in response.json()["items"]]

    assert keys({"namespace_prefix": ["a"]}) == ["1", "2", "3"]  # not ("ab",): segments match whole
    assert keys({"namespace_prefix": ["a"], "limit": 1, "offset": 1}) == ["2"]
    assert keys({}) == ["1", "2", "3", "4", "5"]

    namespaces = url("store", "namespaces")
    listed = api.post(namespaces, {}, format="json").json()["namespaces"]
    assert listed == [["a"], ["a", "b"], ["ab"], ["c"]]
    assert api.post(namespaces, {"prefix": ["a"], "limit": 1, "offset": 1}, format="json").json() == {
        "namespaces": [["a", "b"]]
    }


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"namespace": ["a", ""], "key": "k", "value": 1}, "namespace"),
        ({"namespace": [], "key": "k", "value": 1}, "namespace"),
        ({"namespace": "a", "key": "k", "value": 1}, "namespace"),
        ({"namespace": ["a", 1], "key": "k", "value": 1}, "namespace"),
        ({"namespace": ["a"], "key": 1, "value": 1}, "key"),
        ({"namespace": ["a"], "key": "nul\x00", "value": 1}, "key"),
        ({"namespace": ["a"], "key": "k"}, "value"),
        ({"namespace": ["a"], "key": "k", "value": 1, "ttl": -1}, "ttl"),
        ({"namespace": ["a"], "key": "k", "value": 1, "ttl": "10"}, "ttl"),
        ({"namespace": ["a"], "key": "k", "value": 1, "ttl": 1e300}, "ttl"),
        ({"namespace": ["a"], "key": "k", "value": 1, "ttl": 10**400}, "ttl"),  # JSON's integers have no bound
        ({"namespace": ["a"], "key": "k", "value": 1, "ttl": -(10**400)}, "ttl"),
        ({"namespace": ["a"], "key": "k", "value": 1, "if_absent": "yes"}, "if_absent"),
        ({"namespace": ["a"], "key": "k", "value": "x" * 200}, "value"),
    ],
)
def test_bad_puts_are_refused_and_write_nothing(api, alias, settings, body, field):
    settings.AFKMEMORY = {**settings.AFKMEMORY, "API_MAX_VALUE_BYTES": 100}
    assert field in errors(api.put(ITEMS, body, format="json"))
    assert not models.StoreItem.objects.using(alias).exists()


def test_bad_addresses_and_pages_are_refused(api):
    assert set(errors(api.get(ITEMS))) == {"namespace", "key"}
    assert "namespace" in errors(api.get(at(["a", ""], "k")))
    assert "namespace" in errors(api.delete(at(["a", "nul\x00"], "k")))
    assert "key" in errors(api.get(url("store", "items", namespace=["a"])))
    search = url("store", "items", "search")
    assert "limit" in errors(api.post(search, {"limit": -1}, format="json"))
    assert "limit" in errors(api.post(search, {"limit": 501}, format="json"))
    assert "offset" in errors(api.post(search, {"offset": -1}, format="json"))
    assert "namespace_prefix" in errors(api.post(search, {"namespace_prefix": [""]}, format="json"))
    assert "prefix" in errors(api.post(url("store", "namespaces"), {"prefix": "a"}, format="json"))


def test_items_of_another_tenant_answer_404(api, other, alias):
    assert put(api, ["users", "u1"], "secret", "alice's").status_code == 201
    assert other.get(at(["users", "u1"], "secret")).status_code == 404
    assert other.delete(at(["users", "u1"], "secret")).status_code == 404
    assert other.post(url("store", "items", "search"), {}, format="json").json() == {"items": []}
    assert other.post(url("store", "namespaces"), {}, format="json").json() == {"namespaces": []}
    # Bob's claim on the same address is his own: created, not a lost claim.
    assert put(other, ["users", "u1"], "secret", "bob's", if_absent=True).status_code == 201
    assert api.get(at(["users", "u1"], "secret")).json()["value"] == "alice's"
    assert other.get(at(["users", "u1"], "secret")).json()["value"] == "bob's"
    assert models.StoreItem.objects.using(alias).count() == 2
