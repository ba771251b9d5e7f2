"""The one YAML loader for everything CPN reads: API bodies, cpnctl's manifests and config, catalogues.

A SafeLoader that (1) reads `1e5` as a number, (2) refuses a key given twice in one mapping, and (3) refuses
anchors and aliases: 413 bytes of nested `&a [*a, ...]` name 10^8 values, and every walk after loading
expands them (issue 35, H1: 25 s of the API's event loop). No pydantic here, so cpnctl starts fast.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class ManifestLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus numbers in scientific notation without a dot (`1e5`,
    `2.5E-3`), which YAML 1.1 leaves as strings but every user means as a number; a key given twice
    in one mapping is an error (PyYAML keeps the last silently, so `tokens: 30720` then `tokens: 99`
    would train on 99 without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        """Refuse anchors and aliases before they are composed: 413 bytes of nested `&a [*a, ...]` name
        10^8 values, and every later walk (depth and NUL checks, validation) expands them (issue 35,
        H1). A manifest never needs one: write the value out."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, ALIAS_REFUSED, event.start_mark)
        return super().compose_node(parent, index)


ALIAS_REFUSED = ("YAML anchors and aliases (&name, *name, <<: *name) are not supported: "
                 "write each value out in full")


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    """Raise at the second occurrence of a key written in `node` itself (a `<<` merge's keys may be
    overridden: that is what merging is for)."""
    first: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            earlier = first.setdefault(key, key_node)
        except TypeError:  # an unhashable key: the base constructor says so
            continue
        if earlier is not key_node:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first set at line {earlier.start_mark.line + 1})",
                key_node.start_mark)


ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class ManifestSyntaxError(ValueError):
    """A YAML or JSON document that does not parse; the message carries line and column."""


class YamlAliasError(ManifestSyntaxError):
    """Well-formed YAML that uses an anchor or alias, which CPN does not read (ALIAS_REFUSED)."""


def _syntax_error(exc: yaml.YAMLError, source: str) -> ManifestSyntaxError:
    if getattr(exc, "problem", None) == ALIAS_REFUSED:
        return YamlAliasError(yaml_error_message(exc, source).replace("malformed YAML at ", "", 1))
    return ManifestSyntaxError(yaml_error_message(exc, source))


def yaml_error_message(exc: yaml.YAMLError, source: str = "") -> str:
    where = f"{source}: " if source else ""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    text = f"{problem} ({context})" if context else problem
    if mark is None:
        return f"{where}malformed YAML: {text}"
    return f"{where}malformed YAML at line {mark.line + 1} column {mark.column + 1}: {text}"


def load_yaml(text: str, source: str = "") -> Any:
    try:
        return yaml.load(text, Loader=ManifestLoader)  # noqa: S506 - ManifestLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, source) from exc


def load_yaml_all(text: str, source: str = "") -> list[Any]:
    try:
        return [d for d in yaml.load_all(text, Loader=ManifestLoader) if d is not None]  # noqa: S506
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, source) from exc
