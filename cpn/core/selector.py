"""Kubernetes label selectors, read by a hand-written scanner in one pass over at most MAX_LENGTH characters.

Grammar (what Kubernetes accepts, and what the API publishes as SELECTOR_PATTERN):

    selector := "" | term ("," term)*
    term     := " "* ( key " "* ("=" | "==" | "!=") " "* value
                     | key " "+ ("in" | "notin") " "+ "(" " "* value (" "* "," " "* value)* " "* ")"
                     | "!" key | key ) " "*
    key      := [prefix "/"] name        prefix := [a-z0-9.-]{1,253}
    name     := 1-63 of [-A-Za-z0-9_.], starting and ending with a letter or digit;  value := "" | name

Why by hand: the regex of this grammar, run by Python's backtracking `re`, took 66 s on a 61-character
selector (`a in ( , , , ... !`) on the event loop and froze the whole API (issue 35, C3). The scanner
looks at each character a bounded number of times, so its cost is linear in the (capped) length.
"""

from __future__ import annotations

from cpn.core import errors

MAX_LENGTH = 1024
HELP = ("a label selector is a comma-separated list of key=value, key!=value, key in (a,b), "
        "key notin (a,b), key (exists) or !key (absent)")
FIELD = "labelSelector"
Term = tuple[str, str, frozenset[str] | None]

_NAME_CHARS = frozenset("-_.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_PREFIX_CHARS = frozenset("-.abcdefghijklmnopqrstuvwxyz0123456789")
_KEY_CHARS = _NAME_CHARS | {"/"}

# The same grammar as a regex for the published OpenAPI document, written so that every string has at most
# one way to match each part (no two adjacent quantifiers can share a space): linear for a backtracking engine
# too. The server itself does not run it; tests/api/test_bounded_work.py checks the two agree.
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = rf"(?:[a-z0-9.-]{{1,253}}/)?{_NAME}"
_VALUE_SP = rf"(?:{_NAME} *)?"  # a possibly empty value and the spaces after it
_TERM = (rf" *(?:{_KEY} *(?:==|!=|=) *{_VALUE_SP}"
         rf"|{_KEY} +(?:in|notin) +\( *{_VALUE_SP}(?:, *{_VALUE_SP})*\) *"
         rf"|!{_KEY} *|{_KEY} *)")
SELECTOR_PATTERN = rf"^(?:{_TERM}(?:,{_TERM})*)?$"


def _bad(message: str) -> errors.InvalidInput:
    return errors.InvalidInput(message, field=FIELD)


def _is_name(word: str) -> bool:
    return (0 < len(word) <= 63 and word[0].isascii() and word[0].isalnum() and word[-1].isascii()
            and word[-1].isalnum() and all(c in _NAME_CHARS for c in word))


def _check_key(key: str, term: str) -> str:
    prefix, slash, name = key.rpartition("/")
    ok = _is_name(name) and (not slash or (0 < len(prefix) <= 253 and all(c in _PREFIX_CHARS for c in prefix)))
    if not key:
        raise _bad(f"empty key in label selector; {HELP}")
    if not ok:
        raise _bad(f"{key!r} in {term!r} is not a label key: [prefix/]name, the name 1-63 letters, digits, "
                   f"'-', '_' or '.', starting and ending with a letter or digit")
    return key


def _check_value(value: str, term: str) -> str:
    if value and not _is_name(value):
        raise _bad(f"{value!r} in {term!r} is not a label value: empty, or 1-63 letters, digits, '-', '_' or "
                   f"'.', starting and ending with a letter or digit")
    return value


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos:self.pos + n]

    def spaces(self) -> int:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1
        return self.pos - start

    def word(self, chars: frozenset[str]) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in chars:
            self.pos += 1
        return self.text[start:self.pos]

    def term_text(self, start: int) -> str:
        """The term being read, for messages: from its start to the next comma outside parentheses."""
        end = self.text.find(",", self.pos)
        return self.text[start:end if end >= 0 else len(self.text)].strip()

    def at_term_end(self) -> bool:
        return self.pos == len(self.text) or self.text[self.pos] == ","


def _set_values(sc: _Scanner, key: str, op: str, start: int) -> frozenset[str]:
    if sc.peek() != "(":
        raise _bad(f"{sc.term_text(start)!r}: write the values in parentheses, e.g. {key} {op} (a,b)")
    sc.pos += 1
    values: list[str] = []
    while True:
        sc.spaces()
        values.append(_check_value(sc.word(_NAME_CHARS), sc.term_text(start)))
        sc.spaces()
        ch = sc.peek()
        sc.pos += 1
        if ch == ")":
            return frozenset(v for v in values if v)
        if ch != ",":
            text = sc.text[start:].strip()
            what = "unclosed '(' in label selector" if not ch else f"unexpected {ch!r} in the values of"
            raise _bad(f"{what} {text!r}; {HELP}")


def _term(sc: _Scanner) -> Term:
    sc.spaces()
    start = sc.pos
    if sc.peek() == "!" and sc.peek(2) != "!=":
        sc.pos += 1
        key, op, values = _check_key(sc.word(_KEY_CHARS), sc.term_text(start)), "absent", None
    else:
        key = sc.word(_KEY_CHARS)
        gap = sc.spaces()
        op2 = sc.peek(2)
        if op2 in ("==", "!="):
            sc.pos += 2
        elif op2[:1] == "=":
            sc.pos += 1
        if op2[:1] == "=" or op2 == "!=":
            _check_key(key, sc.term_text(start))
            op = "!=" if op2 == "!=" else "="
            sc.spaces()
            values = frozenset({_check_value(sc.word(_NAME_CHARS), sc.term_text(start))})
        elif gap and sc.word(_NAME_CHARS) in ("in", "notin") and sc.spaces():
            op = sc.text[start:sc.pos].split()[-1]
            _check_key(key, sc.term_text(start))
            values = _set_values(sc, key, op, start)
        else:
            sc.pos = start + len(key) + gap
            if not sc.at_term_end():
                words = sc.term_text(start).split()
                if len(words) >= 2 and words[1] in ("in", "notin"):
                    raise _bad(f"{sc.term_text(start)!r}: write the values in parentheses, "
                               f"e.g. {words[0]} {words[1]} (a,b)")
                raise _bad(f"cannot read {sc.term_text(start)!r}; {HELP}")
            key, op, values = _check_key(key, sc.term_text(start)), "exists", None
    sc.spaces()
    if not sc.at_term_end():
        ch = sc.peek()
        what = "unbalanced ')' in label selector" if ch == ")" else f"unexpected {ch!r} in"
        raise _bad(f"{what} {sc.term_text(start) or sc.text!r}; {HELP}")
    return key, op, values


def parse_selector(text: str | None) -> list[Term]:
    """`a=b,c!=d,e in (x,y),f notin (z),g,!h` → terms as Kubernetes reads them (equality and set-based)."""
    text = text or ""
    if len(text) > MAX_LENGTH:
        raise _bad(f"the label selector is {len(text)} characters long; at most {MAX_LENGTH} are read")
    if not text:
        return []
    sc, out = _Scanner(text), []
    while True:
        out.append(_term(sc))
        if sc.pos == len(text):
            return out
        sc.pos += 1  # the comma


def matches(labels: dict[str, str], selector: list[Term]) -> bool:
    for key, op, values in selector:
        value = labels.get(key)
        if op in ("=", "in") and value not in (values or ()):
            return False
        if op in ("!=", "notin") and value in (values or ()):
            return False
        if op == "exists" and key not in labels or op == "absent" and key in labels:
            return False
    return True
