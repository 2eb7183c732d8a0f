"""SGLang's multimodal hash text to `EmbeddingKey`: strict, injective, never truncating.

SGLang hands its embedding store ``str(h)`` of an int hash: 64-bit values from its CPU
``tensor_hash`` (mmkey's `HashScheme.SGLANG`, bit for bit), and wider ones elsewhere (a
128-bit ``uuid4().int`` when hashing is skipped, hashes a caller supplied). Canonical
decimal text below ``2**64`` keeps its value under `HashScheme.SGLANG`, so a fleet keeps
its digests; wider text is an opaque identifier under `HashScheme.ID`. Any other text is
`InvalidKey`: no sign, no leading zero, no white space, no ``_``, no non-ASCII digit.
"""

from __future__ import annotations

import functools
import re

from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.errors import InvalidKey
from mmkey.hashing import identifier_digest
from mmkey.keys import EmbeddingKey

__all__ = ["SGLANG_HASH_LIMIT", "sglang_digest", "sglang_key"]

SGLANG_HASH_LIMIT = 1 << 64
"""Hash values below this are `HashScheme.SGLANG` digests; larger ones are identifiers."""

_CANONICAL_DECIMAL = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_MAX_SGLANG_DIGITS = len(str(SGLANG_HASH_LIMIT - 1))  # 20


def sglang_digest(text: str) -> tuple[HashScheme, MMHash]:
    """The scheme and digest of one SGLang hash text; `InvalidKey` for non-canonical text.

    ``"0"`` .. ``"18446744073709551615"`` give `HashScheme.SGLANG` with that value; longer
    canonical decimal gives `HashScheme.ID` with ``identifier_digest(text)``.
    """
    value: object = text
    if not isinstance(value, str):
        raise TypeError(
            f"SGLang hashes reach the store as decimal text, got {type(value).__name__}; "
            "pass str(h)"
        )
    if _CANONICAL_DECIMAL.fullmatch(text) is None:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise InvalidKey(
            f"SGLang hash {shown!r} is not canonical decimal text (ASCII digits, no sign, "
            "no leading zero, no white space or '_'); the store receives str(int_hash)"
        )
    if len(text) <= _MAX_SGLANG_DIGITS:
        number = int(text)
        if number < SGLANG_HASH_LIMIT:
            return HashScheme.SGLANG, MMHash(number)
    return HashScheme.ID, identifier_digest(text)


@functools.lru_cache(maxsize=8192)
def sglang_key(namespace: str, modality: Modality, text: str) -> EmbeddingKey:
    """The `EmbeddingKey` of SGLang hash text under `namespace` and `modality`.

    Remembers the last 8192 keys (keys are immutable): SGLang asks whether a hash exists,
    then fetches or stores it, so each key is built once.
    """
    scheme, digest = sglang_digest(text)
    return EmbeddingKey(namespace, modality, scheme, digest)
