"""Cache keys: the `CacheKey` protocol and `EmbeddingKey`, key format v1.

Key format v1 is ``mmk1@<namespace>@<modality>@<scheme>@<digest>``: the namespace
percent-encoded (``A-Z a-z 0-9 - . _ ~`` kept, every other UTF-8 byte as upper-case
``%XX``), the digest in lower-case hex zero-padded to its scheme's width. The parser
accepts exactly what `EmbeddingKey.to_key` writes and nothing else.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterable
from itertools import repeat
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from mmkey.digest import HashScheme, MMHash, Modality, mm_hash
from mmkey.errors import InvalidDigest, InvalidKey

__all__ = [
    "KEY_FORMAT",
    "MAX_NAMESPACE_CHARS",
    "CacheKey",
    "EmbeddingKey",
    "key_text",
]

KEY_FORMAT = "mmk1"
"""The prefix of key format v1; a future format is ``mmk2``."""

MAX_NAMESPACE_CHARS = 256
"""Longest namespace, in characters before encoding."""

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_BYTE_TEXT = tuple(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in range(256))
_KEY_ALPHABET = re.compile(r"[A-Za-z0-9._~%@-]+", re.ASCII)
_KEY_V1 = re.compile(
    r"mmk1@((?:[A-Za-z0-9._~-]|%[0-9A-F]{2})+)@(image|video|audio)@(blake3|xxh3|sglang|id)@([0-9a-f]+)",
    re.ASCII,
)
_MODALITIES = {m.value: m for m in Modality}
_SCHEMES = {s.value: s for s in HashScheme}
_MIDDLE = {(m, s): f"@{m.value}@{s.value}@" for m in Modality for s in HashScheme}
_DIGEST_BYTES = {s: s.bits // 8 for s in HashScheme}


@runtime_checkable
class CacheKey(Protocol):
    """Anything that can name a cache entry; `to_key` is the only road to store text."""

    def to_key(self) -> str:
        """The store key text of this key."""
        ...


@functools.lru_cache(maxsize=1024)
def _encode_namespace(namespace: str) -> str:
    try:
        raw = namespace.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(
            f"namespace {namespace!r} is not valid Unicode text ({exc.reason}); "
            "remove lone surrogates, e.g. decode the source bytes with errors='replace'"
        ) from None
    return "".join([_BYTE_TEXT[b] for b in raw])


def _decode_namespace(text: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "%":
            raw.append(int(text[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(text[i]))
            i += 1
    try:
        namespace = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidKey(
            f"namespace {text!r} does not decode to UTF-8 text; keys must come from EmbeddingKey.to_key()"
        ) from None
    return namespace


@functools.lru_cache(maxsize=1024)
def _parse_namespace(text: str) -> str:
    namespace = _decode_namespace(text)
    if not 1 <= len(namespace) <= MAX_NAMESPACE_CHARS:
        raise InvalidKey(f"namespace must have 1 to {MAX_NAMESPACE_CHARS} characters, got {len(namespace)}")
    if _encode_namespace(namespace) != text:
        raise InvalidKey(
            f"namespace {text!r} is not in canonical form (expected "
            f"{_encode_namespace(namespace)!r}): escape only bytes outside "
            "A-Z a-z 0-9 - . _ ~, with upper-case hex"
        )
    return namespace


def _check_namespace(_: object, __: object, namespace: Any) -> None:
    if not isinstance(namespace, str):
        raise TypeError(
            f"EmbeddingKey.namespace must be str, got {type(namespace).__name__}; "
            "name the model, revision and preprocessing, e.g. 'qwen2-vl-7b@rev1'"
        )
    if not 1 <= len(namespace) <= MAX_NAMESPACE_CHARS:
        raise InvalidKey(f"namespace must have 1 to {MAX_NAMESPACE_CHARS} characters, got {len(namespace)}")
    _encode_namespace(namespace)


def _check_modality(_: object, __: object, value: Any) -> None:
    if not isinstance(value, Modality):
        raise TypeError(
            f"EmbeddingKey.modality must be a Modality member, got {value!r}; "
            "convert text with Modality(text), e.g. Modality('image')"
        )


def _check_scheme(_: object, __: object, value: Any) -> None:
    if not isinstance(value, HashScheme):
        raise TypeError(
            f"EmbeddingKey.scheme must be a HashScheme member, got {value!r}; "
            "convert text with HashScheme(text), e.g. HashScheme('blake3')"
        )


@attrs.frozen(slots=True, cache_hash=False)
class EmbeddingKey:
    """The key of one item's embedding: what produced it, and the digest of its features.

    ``namespace`` names what produced the embedding (model, revision, preprocessing), so
    one image under two models gives two keys.
    """

    namespace: str = attrs.field(validator=_check_namespace)
    modality: Modality = attrs.field(validator=_check_modality)
    scheme: HashScheme = attrs.field(validator=_check_scheme)
    digest: MMHash = attrs.field()
    _text: str = attrs.field(init=False, eq=False, repr=False, hash=False)

    @digest.validator
    def _check_digest(self, _: object, digest: MMHash) -> None:
        mm_hash(digest, self.scheme)

    def __attrs_post_init__(self) -> None:
        scheme = self.scheme
        text = (
            f"mmk1@{_encode_namespace(self.namespace)}{_MIDDLE[self.modality, scheme]}"
            f"{self.digest.to_bytes(_DIGEST_BYTES[scheme], 'big').hex()}"
        )
        object.__setattr__(self, "_text", text)

    def to_key(self) -> str:
        """Key format v1 text, e.g. ``mmk1@qwen2-vl@image@blake3@<32 hex digits>``."""
        return self._text

    @classmethod
    def for_digests(
        cls,
        namespace: str,
        modality: Modality,
        scheme: HashScheme,
        digests: Iterable[MMHash],
    ) -> list[EmbeddingKey]:
        """One key per digest under shared parts; checks the parts once, each digest's range.

        The same keys as ``[EmbeddingKey(namespace, modality, scheme, d) for d in digests]``,
        built several times faster for large batches.
        """
        items = list(digests)
        if not items:
            cls(namespace, modality, scheme, MMHash(0))  # still check the shared parts
            return []
        first = cls(namespace, modality, scheme, items[0])
        if cls is not EmbeddingKey:
            return [first] + [cls(namespace, modality, scheme, d) for d in items[1:]]
        rest = items[1:]
        limit = 1 << scheme.bits
        if not (rest and set(map(type, rest)) == {int} and min(rest) >= 0 and max(rest) < limit):
            rest = [mm_hash(d, scheme) for d in rest]  # the precise error; plain ints
        prefix = first._text[: -scheme.hex_width]
        hex_digits = map(bytes.hex, map(int.to_bytes, rest, repeat(_DIGEST_BYTES[scheme]), repeat(_BIG)))
        texts = map(prefix.__add__, hex_digits)
        return [first, *map(_unchecked, repeat(namespace), repeat(modality), repeat(scheme), rest, texts)]

    @classmethod
    def from_key(cls, text: str) -> EmbeddingKey:
        """Parse key format v1 text; raises `InvalidKey` for anything `to_key` cannot write."""
        value: object = text
        if not isinstance(value, str):
            raise TypeError(
                f"EmbeddingKey.from_key() takes str, got {type(value).__name__}; "
                "decode bytes with .decode('ascii') first"
            )
        match = _KEY_V1.fullmatch(text)
        if match is None:
            raise InvalidKey(_explain_mismatch(text))
        ns_text, modality, scheme_text, hex_digest = match.groups()
        scheme = _SCHEMES[scheme_text]
        if len(hex_digest) > scheme.hex_width:
            raise InvalidDigest(
                f"digest {hex_digest!r} is wider than {scheme.value}'s {scheme.bits} bits: "
                f"it must have exactly {scheme.hex_width} hex digits"
            )
        if len(hex_digest) < scheme.hex_width:
            raise InvalidKey(
                f"digest {hex_digest!r} must be zero-padded to {scheme.hex_width} "
                f"lower-case hex digits for {scheme.value}, got {len(hex_digest)}"
            )
        namespace = _parse_namespace(ns_text)
        if cls is not EmbeddingKey:
            return cls(namespace, _MODALITIES[modality], scheme, MMHash(int(hex_digest, 16)))
        # every part is checked above: skip the validators on this hot path
        return _unchecked(namespace, _MODALITIES[modality], scheme, MMHash(int(hex_digest, 16)), text)


_BIG: Literal["big"] = "big"
_NEW = object.__new__
_SET_NAMESPACE, _SET_MODALITY, _SET_SCHEME, _SET_DIGEST, _SET_TEXT = (
    EmbeddingKey.__dict__[name].__set__ for name in ("namespace", "modality", "scheme", "digest", "_text")
)


def _unchecked(
    namespace: str, modality: Modality, scheme: HashScheme, digest: MMHash, text: str
) -> EmbeddingKey:
    """The key of parts its caller has checked, `text` being their key text: the validators and
    the text's building skipped (the one road around them; ``from_key`` and ``for_digests``
    take it, a few times faster than the constructor)."""
    key: EmbeddingKey = _NEW(EmbeddingKey)
    _SET_NAMESPACE(key, namespace)
    _SET_MODALITY(key, modality)
    _SET_SCHEME(key, scheme)
    _SET_DIGEST(key, digest)
    _SET_TEXT(key, text)
    return key


def _explain_mismatch(text: str) -> str:
    shown = text if len(text) <= 120 else text[:117] + "..."
    parts = text.split("@")
    if parts[0] != KEY_FORMAT:
        why = f"it must start with '{KEY_FORMAT}@'"
    elif len(parts) != 5:
        why = "it must have 5 '@'-separated parts: mmk1@<namespace>@<modality>@<scheme>@<digest>"
    elif parts[2] not in _MODALITIES:
        why = f"modality must be one of {', '.join(_MODALITIES)}"
    elif parts[3] not in _SCHEMES:
        why = f"scheme must be one of {', '.join(_SCHEMES)}"
    elif not re.fullmatch(r"[0-9a-f]+", parts[4], re.ASCII):
        why = "the digest must be lower-case hex digits only"
    else:
        why = "the namespace must be percent-encoded: only A-Z a-z 0-9 - . _ ~ and %XX with upper-case hex"
    return f"not a v1 key: {shown!r}: {why}"


_cached_text = operator.attrgetter("_text")


def embedding_key_texts(items: list[object] | tuple[object, ...]) -> list[str] | None:
    """The key text of each item, read from the text each key cached when it was built,
    when every item is exactly an `EmbeddingKey` (checked once for the batch); ``None``
    otherwise (the caller checks each key then)."""
    if set(map(type, items)) != {EmbeddingKey}:
        return None
    return list(map(_cached_text, items))


def key_text(key: object) -> str:
    """The store text of ``key``, checking at run time that it is a `CacheKey`.

    Raises `TypeError` naming the fix for ints, digests and plain strings, and
    `InvalidKey` when a foreign ``to_key()`` returns text outside the key alphabet.
    """
    if type(key) is EmbeddingKey:
        return key.to_key()
    if not isinstance(key, CacheKey):
        raise TypeError(_wrong_key_type(key))
    text: object = key.to_key()
    if not isinstance(text, str):
        raise InvalidKey(f"{type(key).__name__}.to_key() returned {type(text).__name__}, not str")
    if _KEY_ALPHABET.fullmatch(text) is None:
        raise InvalidKey(
            f"{type(key).__name__}.to_key() returned {text[:80]!r}, outside the key alphabet "
            "A-Z a-z 0-9 . _ ~ - % @ (percent-encode the parts)"
        )
    return text


def _wrong_key_type(key: object) -> str:
    name = type(key).__name__
    if isinstance(key, str):
        return (
            f"cache keys must be CacheKey objects, got str {key[:80]!r}; "
            "parse key text with EmbeddingKey.from_key(s)"
        )
    if isinstance(key, int) and not isinstance(key, bool):
        return (
            f"cache keys must be CacheKey objects, got {name} {key!r} (a bare digest?); "
            "wrap it: EmbeddingKey(namespace, modality, scheme, digest)"
        )
    return f"cache keys must be CacheKey objects (with .to_key() -> str), got {name}"
