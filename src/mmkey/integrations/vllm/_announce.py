"""What a producer announces in a finished request's ``ec_transfer_params`` and what a
consumer accepts of it: ``{"mmkey": {"encoded": [key text, ...]}}``, signed with the fleet's
entry secret where one is configured (``"key_id"`` and ``"mac"`` beside ``"encoded"``).

vLLM's OpenAI server takes ``ec_transfer_params`` from the request body, so a consumer treats
them as a client's text: only keys of its own namespace count, anything not of this shape is
ignored (never raised), and under a secret an announcement counts only when its MAC verifies.
A genuine announcement can be replayed; it names keys a producer did encode, and a wait for
them is bounded like every other (see the scheduler side).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

import attrs

from mmkey.entry.auth import EntryKeyring, EntrySecret
from mmkey.errors import InvalidKey
from mmkey.keys import EmbeddingKey

__all__ = ["PARAMS_KEY", "Announcement", "announce", "read_announcement"]

PARAMS_KEY = "mmkey"
"""Our part of ``ec_transfer_params``; other connectors' parts are left alone."""
MAX_KEYS = 1024
"""Keys read of one announcement; an announcement of more is ignored whole."""
_MAX_KEY_CHARS = 1024
_MAC_CONTEXT = b"mmkey vllm announcement v1\x00"


@attrs.frozen(slots=True)
class Announcement:
    """The keys a consumer accepts of one request's announcement, and whether any part of
    it was ignored (`ignored`: why, for the counters and a log line)."""

    keys: frozenset[str] = frozenset()
    ignored: str | None = None


def _mac(secret: EntrySecret, keys: Iterable[str]) -> str:
    hasher = secret.hasher()
    hasher.update(_MAC_CONTEXT)
    for key in keys:
        raw = key.encode("utf-8", "surrogatepass")
        hasher.update(len(raw).to_bytes(4, "little") + raw)
    return str(hasher.hexdigest())


def announce(keys: Iterable[str], keyring: EntryKeyring | None) -> dict[str, Any]:
    """The ``ec_transfer_params`` announcing `keys`, signed under `keyring`'s current secret."""
    encoded = sorted(set(keys))
    ours: dict[str, Any] = {"encoded": encoded}
    if keyring is not None:
        ours["key_id"] = keyring.current.key_id.hex()
        ours["mac"] = _mac(keyring.current, encoded)
    return {PARAMS_KEY: ours}


def read_announcement(
    params: object, namespace: str, keyring: EntryKeyring | None, *, now: float
) -> Announcement:
    """The keys of `namespace` that `params` (a request's ``ec_transfer_params``, any value)
    announce, verified under `keyring` (at `now`, seconds since the epoch) where there is one.
    Never raises: a malformed announcement is empty and says why."""
    try:
        return _read(params, namespace, keyring, now)
    except Exception as exc:  # a hostile value (a str subclass, a dict that raises): nothing
        return Announcement(ignored=f"unreadable ({type(exc).__name__})")


def _read(params: object, namespace: str, keyring: EntryKeyring | None, now: float) -> Announcement:
    if params is None:
        return Announcement()
    if not isinstance(params, dict):
        return Announcement(ignored="not a dict")
    ours = params.get(PARAMS_KEY)
    if ours is None:
        return Announcement()
    if not isinstance(ours, dict):
        return Announcement(ignored=f"{PARAMS_KEY!r} is not a dict")
    encoded = ours.get("encoded")
    if not isinstance(encoded, list) or len(encoded) > MAX_KEYS:
        return Announcement(ignored=f"'encoded' is not a list of at most {MAX_KEYS} keys")
    if not all(type(k) is str and len(k) <= _MAX_KEY_CHARS for k in encoded):
        return Announcement(ignored="'encoded' holds something that is not key text")
    if keyring is not None:
        refusal = _refusal(ours, encoded, keyring, now)
        if refusal is not None:
            return Announcement(ignored=refusal)
    keys: set[str] = set()
    foreign = False
    for text in encoded:
        try:
            key = EmbeddingKey.from_key(text)
        except InvalidKey:
            foreign = True
            continue
        if key.namespace == namespace:
            keys.add(text)
        else:
            foreign = True
    return Announcement(frozenset(keys), "names keys of another namespace or no key" if foreign else None)


def _refusal(ours: dict[Any, Any], encoded: list[str], keyring: EntryKeyring, now: float) -> str | None:
    key_id, mac = ours.get("key_id"), ours.get("mac")
    if type(key_id) is not str or type(mac) is not str:
        return "unsigned, and this fleet has an entry secret"
    try:
        secret = keyring.secret_for(bytes.fromhex(key_id))
    except ValueError:
        secret = None
    if secret is None or secret.expired(now):
        return "signed with a secret this fleet does not accept"
    if not hmac.compare_digest(_mac(secret, sorted(set(encoded))), mac):
        return "its MAC does not verify"
    return None
