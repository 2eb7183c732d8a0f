"""SGLang's multimodal hash text to `EmbeddingKey`: every text maps, injectively, never truncated.

SGLang hands its embedding store ``str(h)`` of its hashes: 64-bit values from its CPU
``tensor_hash`` (mmkey's `HashScheme.SGLANG`, bit for bit), wider ones elsewhere (a 128-bit
``uuid4().int`` when hashing is skipped), and whatever a caller supplied as ``hashes``
(any text). Canonical decimal below ``2**64`` keeps its value under `HashScheme.SGLANG`, so
a fleet keeps its digests; with ``MMKEY_SGLANG_HASH=blake3`` SGLang's hashes are BLAKE3-128
and canonical decimal below ``2**128`` keeps its value under `HashScheme.BLAKE3`. Every
other text (wider decimal, a leading zero, a sign, hex, any caller's id) is an opaque
identifier under `HashScheme.ID`: ``identifier_digest(text)``. Two different texts never share
a key: a value keeps its own scheme, and identifiers are BLAKE3-128 of the whole text. Only
empty text and text with lone surrogates are `InvalidKey`.
"""

from __future__ import annotations

import functools
import re

from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.hashing import identifier_digest
from mmkey.keys import EmbeddingKey

__all__ = ["SGLANG_HASH_LIMIT", "sglang_digest", "sglang_key"]

SGLANG_HASH_LIMIT = 1 << 64
"""Hash values below this are `HashScheme.SGLANG` digests; larger ones are identifiers."""

_CANONICAL_DECIMAL = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_LIMITS = {HashScheme.SGLANG: SGLANG_HASH_LIMIT, HashScheme.BLAKE3: 1 << 128}


def sglang_digest(text: str, hashes: HashScheme = HashScheme.SGLANG) -> tuple[HashScheme, MMHash]:
    """The scheme and digest of one SGLang hash text.

    With `hashes` ``SGLANG`` (SGLang's own 64-bit hashes), ``"0"`` .. ``"18446744073709551615"``
    give `HashScheme.SGLANG` with that value; with ``BLAKE3`` canonical decimal below
    ``2**128`` gives `HashScheme.BLAKE3`. Any other text gives `HashScheme.ID` with
    ``identifier_digest(text)``. `InvalidKey` for empty text or text with lone surrogates,
    `TypeError` for non-text.
    """
    value: object = text
    if not isinstance(value, str):
        raise TypeError(f"SGLang hashes reach the store as text, got {type(value).__name__}; pass str(h)")
    limit = _LIMITS.get(hashes)
    if limit is None:
        raise TypeError(f"hashes must be HashScheme.SGLANG or HashScheme.BLAKE3, got {hashes!r}")
    if len(text) <= 40 and _CANONICAL_DECIMAL.fullmatch(text) is not None:
        number = int(text)
        if number < limit:
            return hashes, MMHash(number)
    return HashScheme.ID, identifier_digest(text)


@functools.lru_cache(maxsize=8192)
def sglang_key(
    namespace: str, modality: Modality, text: str, hashes: HashScheme = HashScheme.SGLANG
) -> EmbeddingKey:
    """The `EmbeddingKey` of SGLang hash text under ``namespace`` and ``modality``.

    Remembers the last 8192 keys (keys are immutable): SGLang asks whether a hash exists,
    then fetches or stores it, so each key is built once.
    """
    scheme, digest = sglang_digest(text, hashes)
    return EmbeddingKey(namespace, modality, scheme, digest)
