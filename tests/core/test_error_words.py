"""Pydantic's length complaints in the user's words: strings in characters, lists and mappings in items,
with the actual length (pydantic gives none for a mapping)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field, ValidationError

from cpn.core import errors


class _M(BaseModel):
    name: str = Field(default="ab", min_length=2, max_length=3)
    items: list[int] = Field(default_factory=lambda: [1], min_length=1)
    codes: dict[str, int] = Field(default_factory=dict, max_length=1)


@pytest.mark.parametrize("data, said", [
    ({"name": "x"}, "name: must have at least 2 characters, got 1"),
    ({"name": "wxyz"}, "name: must have at most 3 characters, got 4"),
    ({"items": []}, "items: must have at least 1 item, got 0"),
    ({"codes": {"a": 1, "b": 2}}, "codes: must have at most 1 item, got 2"),
    ({"codes": {"a": True}}, "got true"),
])
def test_lengths_and_values_read_as_written(data: dict, said: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _M.model_validate(data, strict=isinstance(next(iter(data.values())), dict))
    message = errors.from_validation_error(caught.value).message
    assert said in message and "None" not in message and "should" not in message, message
