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
    """`source: malformed YAML at line L column C: what is wrong in plain words (the parser's own words)`.
    The line is the one to fix: for a key without its colon, the key's line, not the next one where the
    parser noticed."""
    where = f"{source}: " if source else ""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    text = f"{problem} ({context})" if context else problem
    if mark is None:
        return f"{where}malformed YAML: {text}"
    line, column, plain = _plain_words(exc, mark, problem)
    if plain and plain != problem:
        text = f"{plain} (YAML parser: {problem})"
    return f"{where}malformed YAML at line {line} column {column}: {text}"


def _plain_words(exc: yaml.YAMLError, mark: Any, problem: str) -> tuple[int, int, str | None]:
    """(line, column, the problem in a user's words or None) for PyYAML's usual complaints."""
    line, column = mark.line + 1, mark.column + 1
    opened = getattr(exc, "context_mark", None)
    since = f"line {opened.line + 1}" if opened is not None else "above"
    context = getattr(exc, "context", None) or ""
    lines = str(getattr(mark, "buffer", "") or "").replace("\0", "").splitlines()

    def text_of(number: int) -> str:
        return lines[number - 1] if 0 < number <= len(lines) else ""

    if problem == "mapping values are not allowed here":
        here = text_of(line)
        if ":" in here[:mark.column]:
            key = here.split(":", 1)[0].strip().lstrip("- ")
            return line, column, (f"the value of {key!r} holds ': ': put the value in quotes "
                                  f"({key}: \"{here.split(':', 1)[1].strip()}\"), or put a nested key on a line "
                                  "of its own, indented")
        above = next((n for n in range(line - 1, 0, -1) if text_of(n).strip() and
                      not text_of(n).lstrip().startswith("#")), 0)
        if above and ":" not in text_of(above) and not text_of(above).lstrip().startswith(("-", "[", "{")):
            return above, len(text_of(above)) - len(text_of(above).lstrip()) + 1, (
                f"{text_of(above).strip()!r} has no ':' after its key: write key: value")
        return line, column, (f"line {line} is indented more than the line above it, whose key already has a value: "
                              "line the keys of one mapping up under each other")
    if problem.startswith("could not find expected ':'") and opened is not None:
        return opened.line + 1, opened.column + 1, (f"{text_of(opened.line + 1).strip()!r} has no ':' after its "
                                                    "key: write key: value")
    if problem.startswith("expected <block end>"):
        if problem.endswith("'-'"):
            return line, column, ("a list item (- …) where a key was expected: indent the list under its key, "
                                  "or give it a key")
        return line, column, (f"line {line} is indented unlike the keys above it (the mapping that starts on "
                              f"{since}): the keys of one mapping line up under each other")
    if problem == "sequence entries are not allowed here":
        return line, column, ("a list item (- …) on the same line as its key: put the items on the lines below "
                              "the key, indented, or write [a, b]")
    if "flow sequence" in context or "flow mapping" in context:
        brackets = "[ … ]" if "sequence" in context else "{ … }"
        return line, column, (f"the {brackets[0]} opened on {since} is not closed by {brackets[-1]} where expected "
                              f"(inside {brackets} items are separated by ', ')")
    if "quoted scalar" in context and "end of stream" in problem:
        return line, column, f"the quoted text that starts on {since} is never closed: add the closing quote"
    if problem.startswith("found unknown escape character"):
        return line, column, ("a backslash in double quotes starts an escape YAML does not know: use single "
                              "quotes, or write \\\\ for a backslash")
    if problem.startswith("found character '\\t'"):
        return line, column, f"line {line} has a tab: YAML indents with spaces only"
    if problem.startswith("found character") and "cannot start any token" in problem:
        char = problem.split("'")[1] if problem.count("'") >= 2 else "this character"
        return line, column, f"a value cannot start with {char}: put the value in quotes"
    return line, column, None


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
