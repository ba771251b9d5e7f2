"""Issue 35: no request holds the event loop. Each finding's input is refused (422 naming the field) in
bounded time: a label selector that made `re` backtrack (C3), a YAML alias bomb (H1), a pipeline plan with
many data replicas (H2), a PAX header bomb in a bundle (H5)."""

from __future__ import annotations

import random
import re
import time

import pytest

from cpn.core import errors, selector

SELECTOR_BOMB = "a in (" + " , " * 18 + "!"  # 61 characters: 66 s of backtracking in the old pattern


def _timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    try:
        out = fn(*args)
    except errors.InvalidInput as exc:
        out = exc
    return out, time.perf_counter() - start


def test_the_selector_bomb_is_refused_at_once_by_the_parser_and_the_published_pattern() -> None:
    for text in (SELECTOR_BOMB, "a in (" + " , " * 330 + "!", "a=" + " " * 1000 + "!"):
        got, took = _timed(selector.parse_selector, text)
        assert isinstance(got, errors.InvalidInput) and got.field == "labelSelector", got
        assert took < 0.05, took
        start = time.perf_counter()
        assert re.search(selector.SELECTOR_PATTERN, text) is None
        assert time.perf_counter() - start < 0.05


def test_a_selector_past_the_cap_is_refused_naming_labelselector() -> None:
    with pytest.raises(errors.InvalidInput, match="at most 1024") as info:
        selector.parse_selector("a=b," * 300)
    assert info.value.field == "labelSelector"


@pytest.mark.parametrize(("text", "terms"), [
    ("", []),
    ("a=b", [("a", "=", frozenset({"b"}))]),
    (" a == b , c!=d", [("a", "=", frozenset({"b"})), ("c", "!=", frozenset({"d"}))]),
    ("team in (nlp, cv),x.io/env notin ( prod ),g,!h", [
        ("team", "in", frozenset({"nlp", "cv"})), ("x.io/env", "notin", frozenset({"prod"})),
        ("g", "exists", None), ("h", "absent", None)]),
    ("a=", [("a", "=", frozenset({""}))]),
])
def test_valid_selectors_read_as_kubernetes_reads_them(text: str, terms: list) -> None:  # type: ignore[type-arg]
    assert selector.parse_selector(text) == terms


@pytest.mark.parametrize(("text", "words"), [
    ("team in nlp", "parentheses"), ("a b", "cannot read"), ("a in (x", "unclosed"), ("a=b)", "unbalanced"),
    ("a,,b", "empty key"), ("-a=b", "not a label key"), ("a=b=c", "unexpected"), ("a in (x y)", "unexpected"),
])
def test_invalid_selectors_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(errors.InvalidInput, match=words):
        selector.parse_selector(text)


def test_the_parser_and_the_published_pattern_accept_the_same_selectors() -> None:
    """The API publishes SELECTOR_PATTERN and runs the scanner: they must agree on every string."""
    alphabet = [*"ab=!,() ", "in", "notin", " in ", " notin ", "x/", "A", "-", "_", ".", "Z9", "é", "=="]
    rng = random.Random(35)
    pattern = re.compile(selector.SELECTOR_PATTERN)
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        try:
            selector.parse_selector(text)
            parsed = True
        except errors.InvalidInput:
            parsed = False
        assert parsed == (pattern.search(text) is not None), text


async def test_the_selector_bomb_to_the_api_is_a_prompt_422(api) -> None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    r = await api.client.get("/api/v1/jobs", params={"labelSelector": SELECTOR_BOMB}, headers=api.auth("alice"))
    body = await r.json()
    assert r.status == 422 and body["error"]["field"] == "labelSelector", body
    assert time.perf_counter() - start < 1.0
