"""Issue (or show, or replace) the REST API token of an account."""

from __future__ import annotations

from typing import Any, cast

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Field
from rest_framework.authtoken.models import Token

from afkmemory.management import add_database_argument


class Command(BaseCommand):
    help = (
        "Print the API token of an account, creating the token if it has none. Agents send it as "
        "'Authorization: Token <key>'."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="The account's username.")
        parser.add_argument(
            "--create-user",
            action="store_true",
            help="Create the account (with an unusable password) if it does not exist.",
        )
        parser.add_argument(
            "--reset", action="store_true", help="Replace the account's token: the old one stops working."
        )
        add_database_argument(parser, "Database alias of the accounts", tables=False)

    def handle(self, *args: Any, username: str, create_user: bool, reset: bool, database: str, **options: Any) -> None:
        users = get_user_model()._default_manager.db_manager(database)
        lookup = {get_user_model().USERNAME_FIELD: username}
        with transaction.atomic(using=database):
            user = users.filter(**lookup).first()
            if user is None:
                if not create_user:
                    raise CommandError(f"No account {username!r}; pass --create-user to create it.")
                field = cast(Field, get_user_model()._meta.get_field(get_user_model().USERNAME_FIELD))
                try:
                    field.clean(username, None)  # its length and characters, as the admin checks them
                except ValidationError as exc:
                    raise CommandError(f"Cannot create an account {username!r}: {' '.join(exc.messages)}") from None
                user = users.create_user(**lookup, password=None)
            tokens = Token.objects.using(database)
            if reset:
                tokens.filter(user=user).delete()
            token, _ = tokens.get_or_create(user=user)
        self.stdout.write(token.key)
