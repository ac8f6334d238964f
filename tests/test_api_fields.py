"""The API's serializer fields: copies made for each serializer are independent of each other."""

from __future__ import annotations

import copy

import pytest
from rest_framework import serializers

from afkmemory.api.fields import CheckedField, CountField, IdField, TextField
from afkmemory.api.serializers import EventSerializer


def test_each_serializer_gets_its_own_unbound_fields():
    first, second = EventSerializer().fields, EventSerializer().fields
    for name, declared in EventSerializer._declared_fields.items():
        assert first[name] is not declared and first[name] is not second[name]
        assert declared.parent is None and declared.field_name is None  # binding a copy left it alone
        assert first[name].field_name == name and first[name].parent is not second[name].parent
        if isinstance(declared, CheckedField):
            assert first[name].error_messages == declared.error_messages
            assert first[name].error_messages is not declared.error_messages
            assert first[name].style is not declared.style


def test_a_copy_keeps_the_arguments_and_owns_its_dicts_and_validators():
    field = TextField(max_length=5, required=False, help_text="h", validators=[lambda v: None])
    clone = copy.deepcopy(field)
    assert (clone.max_length, clone.required, clone.help_text, clone.default) == (5, False, "h", field.default)
    assert clone.validators == field.validators and clone.validators is not field.validators
    clone.error_messages["null"] = "changed"
    clone.validators.append(lambda v: None)
    assert field.error_messages["null"] != "changed" and len(field.validators) == 1
    assert repr(clone) == repr(field)


def test_a_bound_field_is_copied_unbound():
    class Holder(serializers.Serializer):
        n = CountField(maximum=3)

    bound = Holder().fields["n"]
    clone = copy.deepcopy(bound)
    assert bound.field_name == "n" and clone.field_name is None and clone.parent is None
    assert clone.label is None and clone.source is None  # bind() names it afresh wherever it goes
    assert clone.maximum == 3


def test_copies_validate_like_the_original():
    serializer = EventSerializer(data={"id": "", "type": "message"})
    assert not serializer.is_valid()
    assert serializer.errors == {"id": ["id must not be empty"]}
    with pytest.raises(serializers.ValidationError) as caught:
        copy.deepcopy(IdField()).run_validation(5)
    assert caught.value.detail == ["value must be a string, got int"]
