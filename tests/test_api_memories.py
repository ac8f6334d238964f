"""REST API: long-term memories and their search, on SQLite and PostgreSQL, with two tenants."""

from __future__ import annotations

import math

import pytest

from afkmemory import models
from afkmemory.memory.text import MAX_QUERY_TERMS
from tests.api_helpers import dimensions, errors, url

pytest_plugins = ["tests.api_fixtures"]  # the alias, alice/bob and api/other fixtures
pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


def vec(*head: float) -> list[float]:
    """Return an embedding of the configured length starting with ``head`` (zeros after)."""
    return [*head, *[0.0] * (dimensions() - len(head))]


def remember(client, **fields) -> dict:
    response = client.post(url("memories"), fields, format="json")
    assert response.status_code in (200, 201), response.json()
    return response.json()


def hits(response) -> list[tuple[str, float, float | None]]:
    assert response.status_code == 200, response.json()
    return [(h["memory"]["id"], h["score"], h["similarity"]) for h in response.json()["results"]]


def test_memory_lifecycle(api, alias):
    generated = remember(api, user_id="u1", text="likes tea")
    assert generated["id"].startswith("mem_") and generated["scope"] == "global" and "embedding" not in generated

    created = api.post(url("memories"), {"id": "m1", "user_id": "u1", "text": "v1", "tags": ["a"]}, format="json")
    assert created.status_code == 201
    replaced = api.post(url("memories"), {"id": "m1", "user_id": "u1", "text": "v2"}, format="json")
    assert replaced.status_code == 200
    assert replaced.json()["created_at"] == created.json()["created_at"]  # the first created_at is kept
    assert replaced.json()["tags"] == [] and replaced.json()["text"] == "v2"
    assert api.get(url("memories", "m1")).json() == replaced.json()

    put_new = api.put(url("memories", "m2"), {"user_id": None, "data": {"k": [1, 2]}}, format="json")
    assert put_new.status_code == 201 and put_new.json()["id"] == "m2" and put_new.json()["user_id"] is None
    put_again = api.put(url("memories", "m2"), {"scope": "work"}, format="json")
    assert put_again.status_code == 200 and put_again.json()["data"] == {} and put_again.json()["scope"] == "work"
    assert "id" in errors(api.put(url("memories", "m2"), {"id": "m3"}, format="json"))

    patched = api.patch(url("memories", "m1"), {"tags": ["b"], "metadata": {"src": "chat"}}, format="json")
    assert patched.status_code == 200
    assert (patched.json()["text"], patched.json()["tags"], patched.json()["metadata"]) == (
        "v2",
        ["b"],
        {"src": "chat"},
    )
    assert api.patch(url("memories", "missing"), {"text": "x"}, format="json").status_code == 404

    assert api.delete(url("memories", "m1")).status_code == 204
    assert api.get(url("memories", "m1")).status_code == 404
    assert api.delete(url("memories", "m1")).status_code == 404
    assert models.LongTermMemory.objects.using(alias).count() == 2


def test_a_missing_memory_is_named_in_the_404_as_threads_are(api):
    """Not Django's "No LongTermMemory matches the given query.", which names a model, not the memory."""
    for response in (api.get(url("memories", "nope")), api.delete(url("memories", "nope"))):
        assert response.status_code == 404
        assert response.json()["detail"] == "You have no memory 'nope'."
    patched = api.patch(url("memories", "nope"), {"text": "x"}, format="json")
    assert patched.status_code == 404 and patched.json()["detail"] == "You have no memory 'nope'."


def test_the_embedding_is_write_only_and_kept_by_updates(api):
    remember(api, id="m1", user_id="u1", text="tea", embedding=vec(1, 0))
    api.patch(url("memories", "m1"), {"text": "green tea"}, format="json")
    api.put(url("memories", "m1"), {"user_id": "u1", "text": "green tea"}, format="json")
    found = hits(api.post(url("memories", "search"), {"user_id": "u1", "embedding": vec(1, 0)}, format="json"))
    assert [(ident, round(similarity, 6)) for ident, _, similarity in found] == [("m1", 1.0)]


def test_memory_list_filters_and_pages(api):
    written = [
        remember(api, id="m1", user_id="u1", scope="work", tags=["tea"]),
        remember(api, id="m2", user_id="u1", scope="home", tags=["tea-time"]),
        remember(api, id="m3", user_id="u2", scope="work", tags=["tea", "x"]),
    ]
    # Newest updated_at first, then by id (several may share a millisecond).
    newest_first = [m["id"] for m in sorted(written, key=lambda m: (-m["updated_at"], m["id"]))]

    def listed(**query) -> list[str]:
        response = api.get(url("memories", **query))
        assert response.status_code == 200, response.json()
        return [m["id"] for m in response.json()["results"]]

    assert listed() == newest_first
    assert listed(user_id="u1") == [i for i in newest_first if i in ("m1", "m2")]
    assert listed(scope="work") == [i for i in newest_first if i in ("m1", "m3")]
    assert listed(tag="tea") == [i for i in newest_first if i in ("m1", "m3")]  # exact tags, not substrings
    assert listed(user_id="u1", scope="work", tag="tea") == ["m1"]
    assert listed(limit=1, offset=1) == newest_first[1:2]
    assert "user_id" in errors(api.get(url("memories", user_id="")))
    assert "tag" in errors(api.get(url("memories", tag="nul\x00")))
    assert "limit" in errors(api.get(url("memories", limit=10_000)))


def test_a_tag_is_matched_exactly_with_and_without_a_user(api):
    """``?tag=`` alone and beside ``?user_id=`` are two forms of the test on PostgreSQL (the
    tags index, the user's index): both match the whole tag, whatever its characters."""
    odd = ['say "hi"', "back\\slash", "é", "[1]", "%", "_"]
    for i, tag in enumerate(odd):
        remember(api, id=f"m{i}", user_id="u1", tags=[tag, "x"])
    remember(api, id="other", user_id="u1", tags=["say", "hi", "back", "1", "e"])
    for i, tag in enumerate(odd):
        for query in ({}, {"user_id": "u1"}):
            response = api.get(url("memories", tag=tag, **query))
            assert [m["id"] for m in response.json()["results"]] == [f"m{i}"], (tag, query)
    assert api.get(url("memories", tag="x", user_id="u2")).json()["results"] == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"data": [1]}, "data"),
        ({"tags": ["a", 1]}, "tags"),
        ({"tags": "a"}, "tags"),
        ({"text": 5}, "text"),
        ({"id": "nul\x00"}, "id"),
        ({"id": "notes/2024"}, "id"),  # no URL names it: memories/{id}/ is one path segment
        ({"id": ".."}, "id"),  # HTTP clients resolve memories/../ away
        ({"id": "search"}, "id"),  # memories/search/ is the search endpoint
        ({"id": ""}, "id"),
        ({"scope": None}, "scope"),
        ({"user_id": 7}, "user_id"),
        ({"metadata": {"x": float("inf")}}, None),  # not even JSON: refused by the parser
        ({"embedding": [1.0, 2.0]}, "embedding"),
        ({"embedding": "1,2"}, "embedding"),
        ({"embedding": [0.0] * 8}, "embedding"),
        ({"embedding": [True] * 8}, "embedding"),
        ({"embedding": [10**400, *[1] * 7]}, "embedding"),
    ],
)
def test_bad_memories_are_refused_and_write_nothing(api, alias, body, field):
    if field is None:
        response = api.post(url("memories"), '{"metadata": {"x": Infinity}}', content_type="application/json")
        assert "detail" in errors(response)
    else:
        assert field in errors(api.post(url("memories"), {"user_id": "u1", **body}, format="json"))
    assert not models.LongTermMemory.objects.using(alias).exists()


def test_text_vector_and_fused_search(api):
    remember(api, id="text-only", user_id="u1", text="green tea ceremony", embedding=vec(-1, 0))
    remember(api, id="both", user_id="u1", text="green tea", embedding=vec(1, 1))
    remember(api, id="vector-only", user_id="u1", text="unrelated words", embedding=vec(1, 0))
    remember(api, id="no-match", user_id="u1", text="coffee", embedding=vec(0, -1))
    remember(api, id="other-user", user_id="u2", text="green tea", embedding=vec(1, 0))
    search = url("memories", "search")

    text = hits(api.post(search, {"user_id": "u1", "query": "green tea"}, format="json"))
    assert sorted(ident for ident, _, _ in text) == ["both", "text-only"]
    assert all(similarity is None for _, _, similarity in text)
    assert [score for _, score, _ in text] == [1 / 61, 1 / 62]

    vector = hits(api.post(search, {"user_id": "u1", "embedding": vec(1, 0), "min_score": 0.5}, format="json"))
    assert [ident for ident, _, _ in vector] == ["vector-only", "both"]
    # A null query is no query, as the schema has it (it was a 400).
    nulled = {"user_id": "u1", "query": None, "embedding": vec(1, 0), "min_score": 0.5}
    assert hits(api.post(search, nulled, format="json")) == vector
    assert [round(similarity, 6) for _, _, similarity in vector] == [1.0, round(1 / math.sqrt(2), 6)]

    body = {"user_id": "u1", "query": "green tea", "embedding": vec(1, 0), "min_score": 0.5}
    fused = hits(api.post(search, body, format="json"))
    text_rank = {ident: rank for rank, (ident, _, _) in enumerate(text, start=1)}
    vector_rank = {ident: rank for rank, (ident, _, _) in enumerate(vector, start=1)}
    expected = {
        ident: sum(1 / (60 + ranks[ident]) for ranks in (text_rank, vector_rank) if ident in ranks)
        for ident in {*text_rank, *vector_rank}
    }
    assert fused[0][0] == "both"  # the only memory both rankings found
    assert {ident: score for ident, score, _ in fused} == pytest.approx(expected)
    assert [score for _, score, _ in fused] == sorted((score for _, score, _ in fused), reverse=True)
    assert dict((ident, sim) for ident, _, sim in fused)["text-only"] is None

    limited = hits(api.post(search, {**body, "limit": 1}, format="json"))
    assert [ident for ident, _, _ in limited] == ["both"]
    scoped = hits(api.post(search, {"user_id": "u2", "query": "tea", "scope": "global"}, format="json"))
    assert [ident for ident, _, _ in scoped] == ["other-user"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"user_id": "u1"}, "query"),
        ({"user_id": "u1", "query": None}, "query"),
        ({"query": "tea"}, "user_id"),
        ({"user_id": "u1", "query": 5}, "query"),
        ({"user_id": "u1", "query": "x" * 5000}, "query"),
        ({"user_id": "u1", "embedding": [1.0]}, "embedding"),
        ({"user_id": "u1", "query": "tea", "min_score": 0.5}, "min_score"),
        ({"user_id": "u1", "embedding": [1.0] * 8, "min_score": "high"}, "min_score"),
        ({"user_id": "u1", "query": "tea", "limit": -1}, "limit"),
        ({"user_id": "u1", "query": "tea", "limit": 501}, "limit"),
        ({"user_id": "u1", "query": "tea", "scope": ""}, "scope"),
    ],
)
def test_bad_searches_are_refused(api, body, field):
    assert field in errors(api.post(url("memories", "search"), body, format="json"))


def test_a_text_search_of_too_many_words_is_refused_and_a_fused_one_ranks_by_its_embedding(api):
    """The limit on a query's distinct words (``MAX_QUERY_TERMS``): over three memories of
    256 KiB, 900 words kept PostgreSQL busy eleven minutes, and 1,100 were a 500 on SQLite.
    With an embedding (a user's whole message sent as both, as hybrid search does) the
    embedding ranks alone: a text match of so many words adds next to nothing."""
    remember(api, id="m1", user_id="u1", text="tea", embedding=vec(1, 0))
    remember(api, id="m2", user_id="u1", text="coffee", embedding=vec(0, 1))
    search = url("memories", "search")
    many = " ".join(f"w{n}" for n in range(MAX_QUERY_TERMS + 1))
    for query in (many, " ".join([many] * 30)):
        problem = errors(api.post(search, {"user_id": "u1", "query": query}, format="json"))
        assert problem == {"query": [f"query has {MAX_QUERY_TERMS + 1} distinct words; a text search takes at "
                                     f"most {MAX_QUERY_TERMS} (a match holds every one of them)"]}  # fmt: skip
    fused = api.post(search, {"user_id": "u1", "query": many, "embedding": vec(1, 0), "limit": 1}, format="json")
    alone = api.post(search, {"user_id": "u1", "embedding": vec(1, 0), "limit": 1}, format="json")
    assert fused.status_code == alone.status_code == 200
    assert fused.json() == alone.json() and fused.json()["results"][0]["memory"]["id"] == "m1"
    found = api.post(search, {"user_id": "u1", "query": " ".join(["tea"] * 100)}, format="json")
    assert [hit["memory"]["id"] for hit in found.json()["results"]] == ["m1"]
    schema = api.get(url("schema"), HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    query = schema["components"]["schemas"]["MemorySearchRequest"]["properties"]["query"]
    assert f"at most {MAX_QUERY_TERMS} distinct" in query["description"]  # the schema says so too


@pytest.mark.parametrize("embedding", [[1e-46] * 8, [1e38] * 8])  # no length in float32: a NaN similarity
def test_an_embedding_without_a_float32_length_is_refused_and_one_stored_earlier_is_left_out(
    api, alice, alias, embedding
):
    embedding = embedding[:1] * dimensions()
    remember(api, id="good", user_id="u1", text="tea", embedding=vec(1, 0))
    assert "embedding" in errors(api.post(url("memories"), {"id": "m", "embedding": embedding}, format="json"))
    search = url("memories", "search")
    assert "embedding" in errors(api.post(search, {"user_id": "u1", "embedding": embedding}, format="json"))
    # One written before the check existed (here, past the store): searches still answer. A zero vector
    # has no similarity and is left out; a long one's is computed in float64 (SQLite) or overflows to 0.
    models.LongTermMemory.objects.using(alias).create(
        owner=alice, memory_id="bad", user_id="u1", scope="global", created_at=1, updated_at=1, embedding=embedding
    )
    found = hits(api.post(search, {"user_id": "u1", "embedding": vec(1, 0)}, format="json"))
    assert found[0][0] == "good" and all(math.isfinite(score) for _, score, _ in found)
    if embedding[0] < 1:
        assert [ident for ident, _, _ in found] == ["good"]


def test_memories_of_another_tenant_answer_404(api, other, alias):
    remember(api, id="m1", user_id="u1", text="alice likes green tea", embedding=vec(1, 0))
    assert other.get(url("memories")).json()["count"] == 0
    assert other.get(url("memories", "m1")).status_code == 404
    assert other.patch(url("memories", "m1"), {"text": "hacked"}, format="json").status_code == 404
    assert other.delete(url("memories", "m1")).status_code == 404
    search = url("memories", "search")
    assert hits(other.post(search, {"user_id": "u1", "query": "green tea"}, format="json")) == []
    assert hits(other.post(search, {"user_id": "u1", "embedding": vec(1, 0)}, format="json")) == []
    assert hits(other.post(search, {"user_id": "u1", "query": "tea", "embedding": vec(1, 0)}, format="json")) == []

    # Bob writing the same id writes his own memory; Alice's is untouched.
    assert other.put(url("memories", "m1"), {"user_id": "u1", "text": "bob's"}, format="json").status_code == 201
    assert other.post(url("memories"), {"id": "m1", "text": "bob again"}, format="json").status_code == 200
    assert api.get(url("memories", "m1")).json()["text"] == "alice likes green tea"
    assert models.LongTermMemory.objects.using(alias).count() == 2


def test_the_order_of_a_text_search_does_not_change_with_another_tenants_words(api, other):
    """SQLite ranked with FTS5's bm25, whose word frequencies span every tenant's memories: Bob
    writing "quokka" five times put Alice's zebra-heavier memory first, so she could tell
    whether anyone had written a word. Each memory is now ranked from its own words alone."""
    remember(api, id="m2", user_id="u1", text="zebra zebra quokka")
    remember(api, id="m1", user_id="u1", text="zebra quokka quokka")  # as newly written, or the first id
    search = url("memories", "search")
    before = hits(api.post(search, {"user_id": "u1", "query": "zebra quokka"}, format="json"))
    for i in range(5):
        remember(other, id=f"b{i}", user_id="u1", text=f"quokka number {i}")
    after = hits(api.post(search, {"user_id": "u1", "query": "zebra quokka"}, format="json"))
    # Three of the words each: equals, so the newer (or, in the same millisecond, the first id) leads.
    assert [ident for ident, _, _ in before] == ["m1", "m2"]
    assert after == before


def test_a_put_that_would_create_a_memory_no_url_names_is_refused(api, alias):
    assert "id" in errors(api.put(url("memories", "."), {"text": "x"}, format="json"))
    assert not models.LongTermMemory.objects.using(alias).exists()


def test_delete_answers_204_only_when_it_deleted_the_memory(api, alias, monkeypatch):
    """The delete goes by the row read, not by the ``user_id`` read: a PATCH of ``user_id``
    committed in between left the memory in place behind a 204 (simulated by changing the row
    right after the view's read)."""
    from afkmemory.api import views

    assert api.post(url("memories"), {"id": "m", "user_id": "u1"}, format="json").status_code == 201
    read = views.MemoryViewSet.get_object

    def read_then_another_request_patches(self):
        memory = read(self)
        models.LongTermMemory.objects.using(alias).filter(memory_id="m").update(user_id="u2")
        return memory

    monkeypatch.setattr(views.MemoryViewSet, "get_object", read_then_another_request_patches)
    assert api.delete(url("memories", "m")).status_code == 204
    assert not models.LongTermMemory.objects.using(alias).exists()


def test_a_delete_that_finds_the_memory_gone_answers_404(api, alias, monkeypatch):
    from afkmemory.api import views

    assert api.post(url("memories"), {"id": "m"}, format="json").status_code == 201
    read = views.MemoryViewSet.get_object

    def read_then_another_request_deletes(self):
        memory = read(self)
        models.LongTermMemory.objects.using(alias).filter(memory_id="m").delete()
        return memory

    monkeypatch.setattr(views.MemoryViewSet, "get_object", read_then_another_request_deletes)
    assert api.delete(url("memories", "m")).status_code == 404


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_racing_creates_of_one_memory_answer_201_once(alice, alias):
    """The status comes from the upsert's own statement: of four clients creating one id at once,
    one created it (201) and three replaced it (200). A read before the write told every client
    that read before the first insert 201."""
    import threading

    from django.db import connections

    from tests.api_helpers import client_for

    for n in range(6):
        barrier, codes = threading.Barrier(4), []

        def create(n=n, barrier=barrier, codes=codes):
            client = client_for(alice)
            try:
                barrier.wait()
                codes.append(client.post(url("memories"), {"id": f"m{n}"}, format="json").status_code)
            finally:
                for connection in connections.all():
                    connection.close()

        workers = [threading.Thread(target=create) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert sorted(codes) == [200, 200, 200, 201], (n, codes)


# -- cursor pages ------------------------------------------------------------------------------

#: Ids that sort by code point, not by locale or length: "m10" before "m9", "Z" before "a", "é" after both.
CURSOR_IDS = ["m9", "m10", "Zed", "apple", "mé", "m\u2603", 'q"uote', "dot.ted", "m 1", "m~", "m0", "m00", "m1"]


def _stored_memories(owner, alias: str) -> list[dict]:
    """Memories written with chosen ``updated_at`` (three or four share each), users, scopes and tags."""
    rows = [
        {
            "memory_id": memory_id,
            "user_id": ("u1", "u2", None)[i % 3],
            "scope": ("work", "home")[i % 2],
            "tags": [["tea"], ["tea-time"], ["tea", "x"], []][i % 4],
            "updated_at": 1000 + i // 4,
        }
        for i, memory_id in enumerate(CURSOR_IDS)
    ]
    models.LongTermMemory.objects.using(alias).bulk_create(
        [models.LongTermMemory(owner=owner, created_at=1, **row) for row in rows]
    )
    return sorted(rows, key=lambda row: (-row["updated_at"], row["memory_id"]))


def walk(client, path: str, **query) -> list[list[str]]:
    """Follow ``next`` from ``path?query`` to the last page; return each page's ids (memories' or threads')."""
    pages, response = [], client.get(url(path, **query))
    while True:
        assert response.status_code == 200, response.json()
        body = response.json()
        assert set(body) == {"next", "results"}, body  # no count, no previous
        pages.append([row.get("id", row.get("thread_id")) for row in body["results"]])
        if body["next"] is None:
            return pages
        response = client.get(body["next"])


def cursor_of(response) -> str:
    from urllib.parse import parse_qs, urlsplit

    [cursor] = parse_qs(urlsplit(response.json()["next"]).query)["cursor"]
    return cursor


def test_memory_cursor_pages_list_every_memory_once_in_order(api, alice, alias):
    newest = _stored_memories(alice, alias)
    ids = [row["memory_id"] for row in newest]
    pages = walk(api, "memories", page_size=3)
    assert [len(page) for page in pages] == [3, 3, 3, 3, 1]
    assert [i for page in pages for i in page] == ids  # ties of updated_at broken by memory_id, none twice
    assert walk(api, "memories", page_size=len(ids)) == [ids]  # a last page that is full has no next
    assert walk(api, "memories", page_size=500) == [ids]
    # The default stays the offset pages, counted.
    assert set(api.get(url("memories")).json()) == {"count", "next", "previous", "results"}


@pytest.mark.parametrize(
    "query",
    [{"user_id": "u1"}, {"scope": "work"}, {"tag": "tea"}, {"user_id": "u2", "scope": "home"}],
    ids=["user", "scope", "tag", "user_scope"],
)
def test_memory_cursor_pages_keep_the_filters(api, alice, alias, query):
    newest = _stored_memories(alice, alias)
    wanted = {"user_id": lambda row, v: row["user_id"] == v, "scope": lambda row, v: row["scope"] == v}
    wanted["tag"] = lambda row, v: v in row["tags"]
    expected = [row["memory_id"] for row in newest if all(wanted[k](row, v) for k, v in query.items())]
    assert len(expected) >= 2
    pages = walk(api, "memories", page_size=2, **query)
    assert [i for page in pages for i in page] == expected and len(pages) == (len(expected) + 1) // 2
    offset = api.get(url("memories", limit=500, **query)).json()
    assert [m["id"] for m in offset["results"]] == expected and offset["count"] == len(expected)


def test_a_memory_cursor_is_bound_to_its_query_and_signed(api, alice, alias, settings):
    _stored_memories(alice, alias)
    first = api.get(url("memories", page_size=2, user_id="u1"))
    cursor = cursor_of(first)
    assert api.get(url("memories", page_size=5, user_id="u1", cursor=cursor)).status_code == 200  # any page size
    for query in ({"user_id": "u2"}, {}, {"user_id": "u1", "scope": "work"}):  # other filters: not this walk
        assert "cursor" in errors(api.get(url("memories", cursor=cursor, **query)))
    encoded, tag = cursor.rsplit(".", 1)
    import base64
    import json

    updated_at, memory_id = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    assert memory_id == first.json()["results"][-1]["id"]
    for altered in ([updated_at, "m0"], [updated_at + 1, memory_id], [str(updated_at), memory_id], [updated_at]):
        forged = base64.urlsafe_b64encode(json.dumps(altered, separators=(",", ":")).encode()).decode().rstrip("=")
        assert "cursor" in errors(api.get(url("memories", page_size=2, user_id="u1", cursor=f"{forged}.{tag}")))
    for garbage in ("", "x", "x.y", "%%%", f"{encoded}.{tag[:-1]}0", f"{encoded}x.{tag}", cursor.replace(".", "")):
        if garbage != cursor:
            assert "cursor" in errors(api.get(url("memories", page_size=2, user_id="u1", cursor=garbage)))
    old_key, settings.SECRET_KEY = settings.SECRET_KEY, "another key"  # rotated: an old cursor is refused,
    assert "cursor" in errors(api.get(first.json()["next"]))  # not read as another place
    settings.SECRET_KEY_FALLBACKS = [old_key]  # unless the old key is a fallback, as Django's signing has it
    following = api.get(first.json()["next"])
    assert following.status_code == 200 and following.json()["results"]
    settings.SECRET_KEY_FALLBACKS = []  # its next link is signed with the new key
    assert api.get(following.json()["next"]).status_code == 200


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ({"page_size": 2, "limit": 2}, "page_size"),
        ({"page_size": 2, "offset": 0}, "page_size"),
        ({"cursor": "x.y", "limit": 1}, "cursor"),
        ({"cursor": "x.y", "offset": 3}, "cursor"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 501}, "page_size"),
        ({"page_size": "ten"}, "page_size"),
    ],
)
@pytest.mark.parametrize("path", ["memories", "threads"])
def test_cursor_and_offset_pages_do_not_mix(api, path, query, name):
    body = errors(api.get(url(path, **query)))
    assert name in body, body


def test_another_accounts_memory_cursor_shows_nothing_of_theirs(api, other, alice, bob, alias):
    _stored_memories(alice, alias)
    models.LongTermMemory.objects.using(alias).create(owner=bob, memory_id="bobs", created_at=1, updated_at=1)
    page = api.get(url("memories", page_size=2))
    # Bob following Alice's link is refused (the cursor is signed for her account), saying nothing of hers.
    response = other.get(page.json()["next"])
    assert "cursor" in errors(response)
    assert not any(memory_id in response.content.decode() for memory_id in CURSOR_IDS)
    # His own walk is his alone, and hers never shows his.
    assert walk(other, "memories", page_size=2) == [["bobs"]]
    assert "bobs" not in {i for page in walk(api, "memories", page_size=2) for i in page}


def test_a_memory_written_during_a_walk_goes_before_the_cursor(api, alice, alias):
    """Pages are not a snapshot. A write stamps a memory now: it moves to the front, behind a walk
    under way, so the walk lists it once if it had got there already, and misses it if not; a new
    one is missed too. Every memory left alone is listed once, in order."""
    ids = [row["memory_id"] for row in _stored_memories(alice, alias)]
    first = api.get(url("memories", page_size=4))
    seen_already, not_yet = ids[1], ids[8]
    for memory_id in (seen_already, not_yet):
        assert api.patch(url("memories", memory_id), {"text": "changed"}, format="json").status_code == 200
    remember(api, id="new", text="written during the walk")
    rest = [i for page in walk(api, "memories", page_size=4, cursor=cursor_of(first)) for i in page]
    assert [m["id"] for m in first.json()["results"]] + rest == [i for i in ids if i != not_yet]
    # A new walk lists them at the front, newest first.
    assert set(walk(api, "memories", page_size=4)[0][:3]) == {"new", not_yet, seen_already}
