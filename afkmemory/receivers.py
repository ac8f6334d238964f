"""Signal receivers, connected in ``AfkMemoryConfig.ready``."""

from __future__ import annotations

from typing import Any

from . import models


def delete_owned_threads(sender: Any, instance: Any, using: str, **kwargs: Any) -> None:
    """Before an account is deleted, delete its threads as ``ThreadQuerySet.delete`` does.

    Django's collector lists what an account's delete takes, then deletes it in one
    transaction. A thread made for the account in between, or a write under a listed
    thread that was still under way, was not listed, and the account's delete failed at
    commit on a foreign key. Deleted here, in that transaction, the threads are all the
    account's (whenever made) and each is taken after the writes under way to it; the
    collector leaves them to this (``models.delete_with_owner``), so each is deleted, and
    heard by the project's receivers, once.

    Then the account's row is locked (PostgreSQL): the collector deletes its memories and
    items by owner next and the account's row last, and a memory or item written in between
    committed (its foreign key check found the row still there), which failed the account's
    delete at commit. Locked, such a write waits for the delete, and then fails on its
    foreign key instead. (Locked after the threads, not before: a transaction that writes to
    a thread and then a memory of the account finishes before the lock is taken, where
    taking it first deadlocked with it.)
    """
    models.Thread.objects.using(using).for_owner(instance).delete()
    type(instance)._base_manager.using(using).filter(pk=instance.pk).select_for_update().exists()
