"""`cpn token revoke` takes a token's id, never the whole token (a secret on a command line lands in
shell history). The secret is base64url, so it may itself start with or contain "_"."""

from __future__ import annotations

import pytest

from cpn.core import errors
from layers.orchestration.identity.tokens import token_id


@pytest.mark.parametrize("ref", ["fa2ff20a1ccd8113", "cpn_fa2ff20a1ccd8113", "cpn_fa2ff20a1ccd8113_", " cpn_fa2ff20a1ccd8113 "])
def test_an_id_or_its_prefix_names_the_token(ref: str) -> None:
    assert token_id(ref) == "fa2ff20a1ccd8113"


@pytest.mark.parametrize("secret", ["h76xdOCnbE5b", "_h76xdOCnbE5b", "__x", "a_b"])
def test_a_whole_token_is_refused_whatever_its_secret_starts_with(secret: str) -> None:
    with pytest.raises(errors.InvalidInput, match="not the whole token") as caught:
        token_id(f"cpn_fa2ff20a1ccd8113_{secret}")
    assert secret not in str(caught.value.message)
