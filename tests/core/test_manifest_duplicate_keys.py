"""A key written twice in one YAML mapping is refused with its line (PyYAML keeps the last silently)."""

from __future__ import annotations

import pytest

from cpn.core.manifest import ManifestSyntaxError, load_yaml, load_yaml_all

TWICE = "kind: TrainingJob\nspec:\n  tokens: 30720\n  model: tiny\n  tokens: 99\n"


def test_a_duplicate_key_names_the_file_line_and_key() -> None:
    with pytest.raises(ManifestSyntaxError) as caught:
        load_yaml_all(TWICE, "job.yaml")
    assert str(caught.value) == ("job.yaml: malformed YAML at line 5 column 3: duplicate key 'tokens' "
                                 "(first set at line 3)")


def test_the_api_loader_refuses_them_too_and_merges_still_override() -> None:
    with pytest.raises(ManifestSyntaxError, match="duplicate key 'tokens'"):
        load_yaml(TWICE)
    merged = load_yaml("job:\n  <<: {tokens: 1, model: tiny}\n  tokens: 2\n")  # no `<<: *b`: aliases are refused
    assert merged["job"] == {"tokens": 2, "model": "tiny"}
    assert load_yaml("a: {x: 1}\nb: {x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}  # same key, other mappings
