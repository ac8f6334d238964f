"""Admin: staff browse threads and their events, state and checkpoints, and edit memories and store items.

What staff type goes through the stores' own checks (``CheckedForm``): the admin cannot
save a row the API or a store would refuse, or could not read back. A thread's records
(events, state, checkpoints, effects) are written by runs: staff see and delete them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.contrib.admin.widgets import ForeignKeyRawIdWidget, url_params_from_lookup_dict
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import (
    BooleanField,
    Count,
    Exists,
    ExpressionWrapper,
    JSONField,
    Model,
    OuterRef,
    Q,
    QuerySet,
    Value,
)
from django.db.models.fields.json import KT
from django.db.models.functions import Concat
from django.forms.fields import InvalidJSONInput, JSONString
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join

from . import models
from .api.fields import check_size
from .memory.journal import LATEST_SUFFIX, CheckpointKey
from .memory.text import query_terms
from .memory.types import (
    EVENT_TYPES,
    MAX_JSON_DEPTH,
    MEMORY_CHECKS,
    StateRetentionPolicy,
    check_json,
    check_memory_id,
    check_object,
    check_path_id,
    now_ms,
)
from .namespaces import check_key, decode
from .querysets import MemoryQuerySet, StoreItemQuerySet

#: The checkpoint phases AFK writes (those its retention policy keeps by default).
AFK_PHASES = StateRetentionPolicy().always_keep_phases


def _ms(value: int | None) -> datetime | int | None:
    """Milliseconds since the epoch as a datetime; as they are past what one holds (year 9999).

    The stores take any 64-bit timestamp, and a client that sends microseconds or
    nanoseconds by mistake writes one far in the future: its row shows the number.
    """
    if value is None:
        return None
    try:
        return datetime.fromtimestamp(value / 1000, tz=UTC)
    except (OverflowError, ValueError, OSError):
        return value


class CheckedForm(forms.ModelForm):
    """A model form whose fields also pass the stores' checks (``checks``: field name to check)."""

    checks: ClassVar[dict[str, Callable[[Any, str], Any]]] = {}

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        for name, check in self.checks.items():
            if name in cleaned:  # absent: the field failed its own validation, or is read-only
                value = cleaned[name]
                try:
                    # A JSON field's string is Django's JSONString: the message says "str".
                    value = str(value) if isinstance(value, JSONString) else value
                    check_size(check(value, name), name)  # and what the API would take
                except (TypeError, ValueError) as exc:
                    self.add_error(name, str(exc))
        return cleaned

    def validate_unique(self) -> None:
        """Also check the model's unique constraints whose fields the form does not edit.

        Django checks a constraint only when all its fields are on the form: the read-only
        ids (``memory_id``, ``thread_id``) and the namespace the form has no field for left
        a duplicate (a memory moved to an account that has its id, an item renamed onto a
        key) to the database: an IntegrityError, a 500. The values are on the instance.
        """
        super().validate_unique()
        opts = self.instance._meta
        constrained = set()
        for constraint in opts.constraints:  # their fields and those their conditions name
            condition = getattr(constraint, "condition", None)
            constrained |= {
                *getattr(constraint, "fields", ()),
                *(condition.referenced_base_fields if condition else ()),
            }
        # A constraint with a condition compares every field it is not told to leave out
        # (an embedding, a numpy array, has no truth value): only the constrained are compared.
        exclude = set(self.errors) | {field.name for field in opts.concrete_fields if field.name not in constrained}
        try:
            self.instance.validate_constraints(exclude=exclude)
        except ValidationError as exc:
            self.add_error(None, exc)


def checked(fields: dict[str, Callable[[Any, str], Any]]) -> type[CheckedForm]:
    return type("Form", (CheckedForm,), {"checks": fields})


class EstimatedCountPaginator(Paginator):
    """A paginator that never counts more than ``count_up_to`` rows of a big table.

    A COUNT(*) of millions of events reads the whole table (or its index) for every page.
    Unfiltered, on PostgreSQL, the count is the planner's estimate (``pg_class.reltuples``,
    as of the last ANALYZE), from ``estimate_from`` rows. A filtered list (a thread's
    events, a search) is counted up to ``count_up_to`` + 1 rows: past that, the list shows
    that many and pages up to there (narrow the filter to reach the rest). Small or never
    analyzed tables, and SQLite's unfiltered lists, are counted exactly: a count under one
    page would list the whole queryset (ChangeList shows all rows when there is one page).
    """

    estimate_from = 10_000
    count_up_to = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        if queryset.query.where:
            # Unordered, so the count stops after that many rows of whatever plan is cheapest.
            return queryset.order_by()[: self.count_up_to + 1].count()
        connection = connections[queryset.db]
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                table = connection.ops.quote_name(queryset.model._meta.db_table)
                cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table])
                estimate = int(cursor.fetchone()[0])  # -1: never analyzed
            if estimate >= self.estimate_from:
                return estimate
        return super().count


class NestedJSONField(forms.JSONField):
    """Django's JSON form field, with JSON nested past what Python's parser takes a form error.

    Django catches only a ``JSONDecodeError``: a RecursionError was a 500. (JSON nested
    past ``MAX_JSON_DEPTH`` but parsed is refused by the stores' checks, ``CheckedForm``.)
    """

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise ValidationError(f"JSON nested more than {MAX_JSON_DEPTH} levels deep", code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:  # the form shown again with its errors: the text as typed
            return InvalidJSONInput(data)


class RawIdWidget(ForeignKeyRawIdWidget):
    """The raw id alone, without the object's name: for staff who may not view that object."""

    def label_and_url_for_value(self, value: Any) -> tuple[str, str]:
        return "", ""


#: The lookups Django's field list filters send (choices, booleans, dates, related rows, empty values).
FIELD_FILTER_LOOKUPS = ("exact", "isnull", "in", "gte", "lt", "id__exact", "id__in", "id__isnull")


def _limits_choices(model: type[Model], lookup: str, value: str) -> bool:
    """Whether ``lookup=value`` is a ``limit_choices_to`` of a foreign key to ``model`` (its raw id popup's)."""
    for fk_lookup in model._meta.related_fkey_lookups:
        if callable(fk_lookup):
            fk_lookup = fk_lookup()
        if (lookup, value) in url_params_from_lookup_dict(fk_lookup).items():
            return True
    return False


#: What a delete page is given: one row (in a list) or the selected rows.
Rows = Sequence[Model] | QuerySet[Any]


class ListAdmin(admin.ModelAdmin):
    """A list that scales with its table: counted by ``EstimatedCountPaginator``, once
    (no "N total" beside a filtered count), and without the JSON columns it does not show.

    With ``exact_search``, the search box finds the rows whose field equals what was typed,
    spaces included: an equality, which an index can serve, where Django's search splits
    the words and matches each as a substring (a scan of the whole table).
    """

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # ?_facets= counted each filter's choices over the whole table
    formfield_overrides = {JSONField: {"form_class": NestedJSONField}}
    exact_search: str | None = None
    #: The lookups the list takes from its URL besides its filters' own parameters: an account's
    #: rows (``?owner__id__exact=``, through the owner's unique index), and links the admin makes.
    url_lookups: frozenset[str] = frozenset({"owner__id__exact"})

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        """Only what the list offers: its filters' parameters, its date hierarchy's, ``url_lookups``,
        and a raw id popup's ``limit_choices_to`` (as Django allows them).

        Django takes any lookup on the model's own columns from the URL, for a staff member
        who may only view: ``?text__regex=^(a+)+$`` (which SQLite runs in Python, its time
        doubling with each character of the text) or a substring scan of every payload.
        """
        offered = set(self.url_lookups)
        if self.date_hierarchy:
            offered |= {f"{self.date_hierarchy}__{part}" for part in ("year", "month", "day")}
        filters = self.get_list_filter(request) if request is not None else self.list_filter
        for spec in filters:
            if isinstance(spec, type) and lookup == getattr(spec, "parameter_name", None):  # a SimpleListFilter
                return super().lookup_allowed(lookup, value, request)
            field = spec if isinstance(spec, str) else str(spec[0]) if isinstance(spec, tuple) else None
            if field is not None:  # what Django's field filters send, not any lookup on the field
                offered |= {field, *(f"{field}__{suffix}" for suffix in FIELD_FILTER_LOOKUPS)}
        return (lookup in offered or _limits_choices(self.model, lookup, value)) and super().lookup_allowed(
            lookup, value, request
        )

    def get_search_fields(self, request: HttpRequest) -> list[str] | tuple[str, ...]:
        return (self.exact_search,) if self.exact_search else super().get_search_fields(request)

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        # Django's raw id widget names the object beside its id (an account's username)
        # whatever the staff member may view.
        related = db_field.remote_field.model._meta
        if db_field.name in self.raw_id_fields and not request.user.has_perm(
            f"{related.app_label}.{get_permission_codename('view', related)}"
        ):
            kwargs["widget"] = RawIdWidget(db_field.remote_field, self.admin_site, using=kwargs.get("using"))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        if not self.exact_search:
            return super().get_search_results(request, queryset, search_term)
        return (queryset.filter(**{self.exact_search: search_term}) if search_term.strip() else queryset), False

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ListChangeList

    def get_deleted_objects(
        self, objs: Rows, request: HttpRequest
    ) -> tuple[list[Any], dict[str, int], set[str], list[Any]]:
        """What deleting the selected rows takes: them alone, counted rather than listed.

        "Select all" of a list can take a thread's 200,000 events or a user's 100,000
        memories, which Django's page would load and list one by one. Where nothing refers
        to the model (a thread's records, memories, store items), nothing else goes; where
        something does (threads, or a model of the project's), the page is Django's.
        """
        if not isinstance(objs, QuerySet) or models.relations_to_delete(self.model):  # one row's page, or relations
            return super().get_deleted_objects(objs, request)
        n = objs.count()
        perms_needed = set() if self.has_delete_permission(request) else {str(self.opts.verbose_name)}
        return [f"{n} {_plural(self.model, n)}"], {str(self.opts.verbose_name_plural): n}, perms_needed, []


#: The default order of an account's records (threads, memories, items): newest first, by the
#: primary key's index. Their models' orders (by id, by update time) have no index over every
#: account's rows, so each page sorted the whole table; a column's header still sorts by it.
NEWEST_FIRST = ("-pk",)


class ListChangeList(ChangeList):
    """A list that shows no JSON: neither its rows' (payloads, values, data) nor their thread's metadata.

    A payload or value is up to the API's value limit: the list defers them, the row's
    change page (which does not use a ChangeList) shows them.
    """

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        # Django sorts by whatever column ?o= names, even where sortable_by offers none.
        if self.sortable_by is not None and not self.sortable_by:
            self.params.pop(ORDER_VAR, None)
        return super().get_ordering(request, queryset)

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        fields = self.model._meta.fields
        json = [field.name for field in fields if isinstance(field, JSONField)]
        if any(field.name == "thread" for field in fields):
            json.append("thread__metadata")
        return super().get_queryset(request, exclude_parameters).defer(*json)


def choices_filter(field: str, values: Iterable[str]) -> type[admin.SimpleListFilter]:
    """A list filter on ``field`` offering ``values``.

    Django's own filter on a plain column lists its distinct values: a scan of the whole
    table (millions of events) on every page of the list.
    """

    class Filter(admin.SimpleListFilter):
        title = field
        parameter_name = field

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return [(value, value) for value in sorted(values)]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            return queryset.filter(**{field: self.value()}) if self.value() else queryset

    return Filter


def typed_filter(field: str, check: Callable[[Any, str], Any]) -> type[admin.SimpleListFilter]:
    """A list filter on ``field`` equal to a value typed into a box, which must pass ``check``.

    For free strings such as a memory's scope: Django's own filter would list the column's
    distinct values, scanning the whole table on every page of the list.
    """

    class Filter(admin.SimpleListFilter):
        title = field.replace("_", " ")
        parameter_name = field
        template = "admin/afkmemory/typed_filter.html"

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return []

        def has_output(self) -> bool:
            return True

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            value = self.value()
            if not value:  # an empty box: all rows
                return queryset
            try:
                check(value, field)
            except (TypeError, ValueError) as exc:
                raise IncorrectLookupParameters(exc) from exc  # the admin shows the list unfiltered, with ?e=1
            return queryset.filter(**{field: value})

        def choices(self, changelist: ChangeList) -> Iterator[Any]:  # with "kept", which the template reads
            # The page's other parameters (search, other filters, ordering) go along as hidden fields.
            kept = [
                (name, value) for name, values in changelist.filter_params.items() if name != field for value in values
            ]
            yield {
                "selected": not self.value(),
                "query_string": changelist.get_query_string(remove=[field]),
                "display": "All",
                "kept": kept,
            }

    return Filter


#: The most threads (one per account) a search of a thread's records looks up by key.
SEARCHED_THREADS = 100


class BigTableAdmin(ListAdmin):
    """A thread's records, as runs wrote them: browsed and deleted, not added or edited.

    Event-sized tables: pages in the order of their (thread, ...) index, not sortable by
    a column (each such sort read the whole table); searched by their thread's exact id,
    which that index serves; foreign keys as raw ids.
    """

    list_per_page = 50
    raw_id_fields = ("thread",)
    list_select_related = ("thread",)
    sortable_by = ()
    url_lookups = frozenset({"thread__id__exact"})  # a thread's "records" links (records have no owner)
    exact_search = "thread__thread_id"
    search_help_text = "A thread id, exactly."

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # The threads' keys first, then their records through the (thread, ...) index in
        # order: through the join, PostgreSQL read a 1,000,000-event thread whole and sorted
        # it for a page of 50 (0.8 s). An id that very many accounts use keeps the join.
        if not search_term.strip():
            return queryset, False
        threads = models.Thread.objects.using(queryset.db).filter(thread_id=search_term).order_by()
        keys = list(threads.values_list("pk", flat=True)[: SEARCHED_THREADS + 1])
        if len(keys) > SEARCHED_THREADS:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(thread__in=keys), False

    def get_ordering(self, request: HttpRequest) -> list[str]:
        # The models' ordering starts with "thread", which Django orders by Thread's own
        # ordering, through a join no index serves (every page sorted the whole table). By the
        # key column, it is the order of each table's (thread, ...) index or unique constraint.
        return ["thread_id" if name == "thread" else name for name in self.model._meta.ordering]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


RECORD_MODELS = models.THREAD_RECORDS


def _records_url(site: admin.AdminSite, model_name: str | None, thread: models.Thread) -> str:
    return reverse(f"{site.name}:afkmemory_{model_name}_changelist") + f"?thread__id__exact={thread.pk}"


def _may_delete(request: HttpRequest, model: type[Model]) -> bool:
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename('delete', opts)}")


def _records_by_thread(model: type[Model], threads: Rows, using: str) -> dict[int, int]:
    """How many rows of ``model`` each of ``threads`` holds (those holding none are left out)."""
    chosen = threads.values("pk") if isinstance(threads, QuerySet) else [thread.pk for thread in threads]
    rows = model._default_manager.using(using).filter(thread__in=chosen)
    return dict(rows.order_by().values_list("thread").annotate(n=Count("pk")))


def _plural(model: type[Model], n: int) -> str:
    return str(model._meta.verbose_name if n == 1 else model._meta.verbose_name_plural)


@admin.register(models.Thread)
class ThreadAdmin(ListAdmin):
    ordering = NEWEST_FIRST
    list_display = ("thread_id", "owner", "created_at", "updated_at", "browse")
    search_fields = ("thread_id",)
    raw_id_fields = ("owner",)
    list_select_related = ("owner",)
    form = checked({"thread_id": check_path_id, "metadata": check_object})

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # A thread is not renamed (the API refuses it too): its records and clients name it.
        return ("created_at", "updated_at") if obj is None else ("thread_id", "created_at", "updated_at")

    @admin.display(description="records")
    def browse(self, thread: models.Thread) -> str:
        names = ("event", "stateentry", "checkpoint", "effect")
        links = [(name, _records_url(self.admin_site, name, thread)) for name in names]
        return format_html_join(" · ", '<a href="{}">{}</a>', ((url, name) for name, url in links))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A thread's delete takes its records: deleting it, or the account it belongs to
        # (whose delete page does not list the records), needs the permission to delete them.
        return super().has_delete_permission(request, obj) and all(_may_delete(request, m) for m in RECORD_MODELS)

    def get_deleted_objects(
        self, objs: Rows, request: HttpRequest
    ) -> tuple[list[Any], dict[str, int], set[str], list[Any]]:
        """What deleting ``objs`` takes: each thread, with a count of each kind of its records.

        Django's page lists every row a delete takes, and loads each to do so: a thread of
        200,000 events took 30 seconds to confirm. The records are counted instead, a
        statement per table, each count a link to the records.
        """
        if models.thread_relations_elsewhere():  # rows of the project's own to list and check
            return super().get_deleted_objects(objs, request)
        threads = list(objs)
        if not threads:
            return [], {}, set(), []
        using = threads[0]._state.db or "default"
        counts = {model: _records_by_thread(model, objs, using) for model in RECORD_MODELS}
        model_count = {str(models.Thread._meta.verbose_name_plural): len(threads)}
        perms_needed = {
            str(m._meta.verbose_name) for m in (models.Thread, *RECORD_MODELS) if not _may_delete(request, m)
        }
        for model, by_thread in counts.items():
            if by_thread:
                model_count[str(model._meta.verbose_name_plural)] = sum(by_thread.values())
        to_delete: list[Any] = []
        for thread in threads:
            url = reverse(f"{self.admin_site.name}:afkmemory_thread_change", args=[thread.pk])
            to_delete.append(format_html('Thread: <a href="{}">{}</a>', url, thread))
            records = [
                format_html(
                    '<a href="{}">{} {}</a>',
                    _records_url(self.admin_site, model._meta.model_name, thread),
                    n,
                    _plural(model, n),
                )
                for model, by_thread in counts.items()
                if (n := by_thread.get(thread.pk, 0))
            ]
            if records:
                to_delete.append(records)
        return to_delete, model_count, perms_needed, []


@admin.register(models.Event)
class EventAdmin(BigTableAdmin):
    list_display = ("event_id", "thread", "type", "when", "user_id")
    list_filter = (choices_filter("type", EVENT_TYPES),)

    @admin.display(description="timestamp", ordering="timestamp")
    def when(self, event: models.Event) -> datetime | int | None:
        return _ms(event.timestamp)


class RunStateAdmin(BigTableAdmin):
    """A run's latest checkpoint and its ``checkpoint:<run>:latest`` pointer are not deleted
    here: a resumed run starts from them, and without them starts over (compaction's state
    policy keeps them too). They go with their thread, or with their run when it is pruned."""

    actions = ["delete_selected"]  # this one, in place of the site's

    def kept(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """The rows of ``queryset`` that are a run's latest checkpoint or its pointer."""
        raise NotImplementedError

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if not super().has_delete_permission(request, obj):
            return False
        return obj is None or not self.kept(self.model._default_manager.using(obj._state.db).filter(pk=obj.pk)).exists()

    @admin.action(permissions=["delete"], description="Delete selected %(verbose_name_plural)s")
    def delete_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        """Django's action on the selected rows but the kept ones, saying how many it keeps:
        its confirmation, its message and the admin log count only what it deletes."""
        kept = self.kept(queryset).count()
        if kept:
            because = "a run's latest checkpoint and its pointer, which a resumed run starts from, are not deleted here"
            self.message_user(request, f"{kept} {_plural(self.model, kept)} kept: {because}", messages.WARNING)
        return django_delete_selected(self, request, queryset.exclude(pk__in=self.kept(queryset).values("pk")))


@admin.register(models.StateEntry)
class StateEntryAdmin(RunStateAdmin):
    list_display = ("key", "thread", "updated_at")

    def kept(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(key__startswith=CheckpointKey.PREFIX, key__endswith=LATEST_SUFFIX)


@admin.register(models.Checkpoint)
class CheckpointAdmin(RunStateAdmin):
    list_display = ("__str__", "thread", "run_id", "step", "phase", "updated_at")
    list_filter = (choices_filter("phase", AFK_PHASES),)

    def kept(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        pointer = models.StateEntry.objects.filter(
            thread=OuterRef("thread"), key=Concat(Value(CheckpointKey.PREFIX), OuterRef("run_id"), Value(LATEST_SUFFIX))
        ).annotate(target=KT("value__key"))
        latest = pointer.filter(target=OuterRef("state_key"))
        return queryset.annotate(state_key=models.Checkpoint.STATE_KEY).filter(Exists(latest))


@admin.register(models.Effect)
class EffectAdmin(BigTableAdmin):
    list_display = ("__str__", "thread", "run_id", "step", "tool_call_id", "created_at")


@admin.register(models.GraphCheckpoint)
class GraphCheckpointAdmin(BigTableAdmin):
    list_display = ("thread", "step", "revision", "ts", "updated_at")


#: The stores' checks of each field of a memory; a new memory's id is one the API's URLs can name.
MEMORY_FORM_CHECKS = {"memory_id" if name == "id" else name: check for name, check in MEMORY_CHECKS.items()}
MEMORY_FORM_CHECKS["memory_id"] = check_memory_id


class MemoryForm(checked(MEMORY_FORM_CHECKS)):  # type: ignore[misc]
    def clean_text(self) -> str | None:
        """An empty box is no text (None, as the API has it), unless the memory's text was ""."""
        text = self.cleaned_data.get("text")
        if text == "" and self.instance.text != "":  # before _post_clean: the stored text
            return None
        return text


@admin.register(models.LongTermMemory)
class LongTermMemoryAdmin(ListAdmin):
    ordering = NEWEST_FIRST
    list_display = ("memory_id", "user_id", "scope", "summary", "updated", "has_embedding")
    list_filter = (typed_filter("user_id", MEMORY_CHECKS["user_id"]), typed_filter("scope", MEMORY_CHECKS["scope"]))
    search_fields = ("memory_id",)  # and the words of the text: get_search_results
    search_help_text = "A memory id, or words of its text (as the API's text search finds them)."
    raw_id_fields = ("owner",)
    fields = ("owner", "memory_id", "user_id", "scope", "text", "data", "tags", "metadata", "created", "updated",
              "embedding_size")  # fmt: skip
    form = MemoryForm

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # Through the text index, as the API searches: a substring match (Django's icontains)
        # read every memory's text on every page of the search.
        # Each branch is of the list's queryset, filters included: from the whole table, a
        # common word found every account's memories, then kept one user's (1 s at 500,000).
        if not search_term.strip():
            return queryset, False
        memories: MemoryQuerySet = queryset.order_by()  # type: ignore[assignment]  # the model's manager's
        found = memories.filter(memory_id=search_term).values("pk")
        try:
            terms = query_terms(search_term)
        except ValueError as too_many:  # as the API refuses it; the id may still match
            self.message_user(request, str(too_many).replace("query", "The search", 1), messages.WARNING)
            terms = []
        if terms:
            # One index each, then their union: an OR of the two conditions read every row.
            found = found.union(memories.matching(terms).values("pk"))
        return queryset.filter(pk__in=found), False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # A memory is not renamed (nor by the API): its clients name it.
        shown = ("created", "updated", "embedding_size")
        return shown if obj is None else ("memory_id", *shown)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # The list shows neither the embedding nor the search text: whether there is an
        # embedding comes from the database, without the vector itself.
        embedded = ExpressionWrapper(Q(embedding__isnull=False), output_field=BooleanField())
        return super().get_queryset(request).defer("search_text", "embedding").annotate(embedded=embedded)

    @admin.display(description="text")
    def summary(self, memory: models.LongTermMemory) -> str:
        text = memory.text or ""
        return text if len(text) <= 80 else text[:79] + "…"

    @admin.display(description="created")
    def created(self, memory: models.LongTermMemory) -> datetime | int | None:
        return _ms(memory.created_at)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, memory: models.LongTermMemory) -> datetime | int | None:
        return _ms(memory.updated_at)

    @admin.display(description="embedding", boolean=True)
    def has_embedding(self, memory: models.LongTermMemory) -> bool:
        return bool(memory.embedded)  # type: ignore[attr-defined]  # get_queryset's annotation

    @admin.display(description="embedding dimensions")
    def embedding_size(self, memory: models.LongTermMemory) -> int | None:
        return None if memory.embedding is None else len(memory.embedding)

    def save_model(self, request: HttpRequest, obj: models.LongTermMemory, form: Any, change: bool) -> None:
        obj.updated_at = now_ms()
        if not change:
            obj.created_at = obj.updated_at
        super().save_model(request, obj, form, change)


class ExpiryFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expiry"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("live", "live"), ("expired", "expired (awaiting the sweep)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        assert isinstance(queryset, StoreItemQuerySet)
        if self.value() == "live":
            return queryset.live()
        if self.value() == "expired":
            return queryset.expired()
        return None


@admin.register(models.StoreItem)
class StoreItemAdmin(ListAdmin):
    ordering = NEWEST_FIRST
    list_display = ("namespace_path", "key", "owner", "updated_at", "expires_at", "live")
    list_filter = (ExpiryFilter,)
    list_select_related = ("owner",)
    exact_search = "key"
    search_help_text = "A key, exactly."
    raw_id_fields = ("owner",)
    readonly_fields = ("namespace_path", "created_at", "updated_at")
    fields = ("owner", "namespace_path", "key", "value", "expires_at", "created_at", "updated_at")
    form = checked({"key": check_key, "value": check_json})

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # items are written through the store, which encodes and validates namespaces

    def save_model(self, request: HttpRequest, obj: models.StoreItem, form: Any, change: bool) -> None:
        obj.updated_at = timezone.now()
        super().save_model(request, obj, form, change)

    @admin.display(description="namespace", ordering="namespace")
    def namespace_path(self, item: models.StoreItem) -> str:
        return " / ".join(decode(item.namespace))

    @admin.display(boolean=True)
    def live(self, item: models.StoreItem) -> bool:
        return item.is_live()
