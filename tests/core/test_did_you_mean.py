"""An unknown field in a manifest names the field it is close to (issue 32, deliver 6): the one place
validation errors become messages (cpn/core/errors.py) adds "did you mean …" from the model's fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cpn.core.errors import from_validation_error
from layers.service.schemas import TrainingJobManifest


def _message(spec: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        TrainingJobManifest.model_validate({"apiVersion": "cpn/v1", "kind": "TrainingJob",
                                            "metadata": {"name": "x"}, "spec": {"model": "tiny", "tokens": 1000,
                                                                                **spec}})
    return str(from_validation_error(caught.value))


def test_a_typo_names_the_field_it_is_close_to() -> None:
    assert _message({"stratgey": "ddp"}) == "spec.stratgey: unknown field (did you mean `strategy`?)"
    assert _message({"gpus": {"mni": 1}}) == "spec.gpus.mni: unknown field (did you mean `min`?)"  # nested model
    assert _message({"globalBatchToken": 1024}).endswith("(did you mean `globalBatchTokens`?)")


def test_a_key_close_to_nothing_gets_no_guess() -> None:
    assert _message({"zzzqq": 1}) == "spec.zzzqq: unknown field"
