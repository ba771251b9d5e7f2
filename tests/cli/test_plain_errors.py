"""Mistakes in a manifest said in a user's words (issue 32, item 6): "did you mean …" for a misspelt
value of a field with fixed choices, as for a misspelt field; broken YAML as what is wrong and on which
line, the parser's own words only in brackets."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.core.errors import closest, from_validation_error
from cpn.core.yamlload import ManifestSyntaxError, load_yaml_all
from layers.service.schemas import TrainingJobSpec
from tests.cli.inproc import cpnctl
from tests.layers.orchestration.test_reconciler import _world


def _invalid(**spec: object) -> str:
    try:
        TrainingJobSpec.model_validate({"model": "tiny", "tokens": 1000, **spec})
    except ValueError as exc:
        return from_validation_error(exc, "spec").message
    raise AssertionError("validated")


def test_a_misspelt_choice_gets_did_you_mean() -> None:
    said = _invalid(strategy="dilco", compression="INT8")
    assert "spec.strategy: must be one of: 'auto'" in said and "got 'dilco' (did you mean `diloco`?)" in said
    assert "got 'INT8' (did you mean `int8`?)" in said  # any case
    assert "did you mean" not in _invalid(strategy="warp-drive")  # nothing close: the list alone
    assert closest(7, ["a"]) == "" and closest("ddpp", ["ddp", "diloco"]) == " (did you mean `ddp`?)"


async def test_apply_says_did_you_mean_for_a_value_and_a_field(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: cpn/v1\nkind: TrainingJob\nmetadata: {name: typo}\n"
                    "spec:\n  model: tiny\n  tokens: 30720\n  strategy: dilco\n  innerStep: 10\n")
    out = await cpnctl(api, "alice", "apply", "-f", str(path))
    assert out.code == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "spec.strategy: must be one of:" in out.stderr and "(did you mean `diloco`?)" in out.stderr
    assert "spec.innerStep: unknown field (did you mean `innerSteps`?)" in out.stderr


YAML_MISTAKES = [  # (text, the line to fix, words that must be in the message)
    ("kind: TrainingJob\nspec:\n  model: tiny: big\n", 3, "the value of 'model' holds ': ': put the value in quotes"),
    ("kind: TrainingJob\nspec:\n  model tiny\n  tokens: 5\n", 3, "'model tiny' has no ':' after its key"),
    ("kind: TrainingJob\nspec:\n  model: tiny\n  tokens\n", 4, "'tokens' has no ':' after its key"),
    ("kind: TrainingJob\nspec:\n\tmodel: tiny\n", 3, "line 3 has a tab: YAML indents with spaces only"),
    ("kind: TrainingJob\nspec:\n  model: tiny\n   tokens: 5\n", 4, "indented more than the line above it"),
    ("kind: TrainingJob\nspec:\n    model: tiny\n  tokens: 5\n", 4, "indented unlike the keys above it"),
    ("spec:\n  gpus: {min: 2, max: 4\n  tokens: 5\n", 3, "the { opened on line 2 is not closed by }"),
    ("kind: [unclosed\n", 2, "the [ opened on line 1 is not closed by ]"),
    ('spec:\n  model: "tiny\n  tokens: 5\n', 4, "the quoted text that starts on line 2 is never closed"),
    ("spec:\n  gpus: - 2\n", 2, "a list item (- …) on the same line as its key"),
    ("spec:\n  model: tiny\n- a\n", 3, "a list item (- …) where a key was expected"),
    ("spec:\n  model: @tiny\n", 2, "a value cannot start with @: put the value in quotes"),
]


@pytest.mark.parametrize(("text", "line", "words"), YAML_MISTAKES)
def test_yaml_mistakes_in_plain_words_with_the_line(text: str, line: int, words: str) -> None:
    with pytest.raises(ManifestSyntaxError) as caught:
        load_yaml_all(text, "job.yaml")
    said = str(caught.value)
    assert said.startswith(f"job.yaml: malformed YAML at line {line} column "), said
    assert words in said, said
    plain = said.split(": ", 2)[2]
    assert not plain.startswith(("mapping values", "expected", "found", "could not", "while")), said  # not jargon first


async def test_apply_of_broken_yaml_names_the_line_in_plain_words(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: cpn/v1\nkind: TrainingJob\nmetadata:\n  name: x\nspec:\n  model: tiny\n"
                    "  note: starts at: noon\n")
    out = await cpnctl(api, "alice", "apply", "-f", str(path))
    assert out.code == 1
    assert out.stderr.strip() == (f"error: {path}: malformed YAML at line 7 column 18: the value of 'note' holds "
                                  "': ': put the value in quotes (note: \"starts at: noon\"), or put a nested key on a "
                                  "line of its own, indented (YAML parser: mapping values are not allowed here)")
