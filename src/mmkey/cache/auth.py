"""Entry authentication: the fleet secret behind the keyed MAC that stored entries carry.

A store reachable by many processes (Mooncake has no access control) lets anyone write a
well-formed entry under any key. With an `EntryKeyring`, every entry a cache writes carries
a BLAKE3 keyed MAC over its header and payload, and a cache reads only entries whose MAC
verifies under the current secret or one of the previous ones (rotation). The entry names
the secret by an 8-byte id derived from it; neither the secret nor the MAC key derived from
it ever appears in a repr, a log line, an error or `stats()`.

Caches read the keyring from the environment when built, unless code passes one:

- ``MMKEY_ENTRY_KEY_FILE``: a file whose bytes, exactly, are the current secret, or
- ``MMKEY_ENTRY_KEY``: the current secret as text (UTF-8); setting both is an error;
- ``MMKEY_ENTRY_KEY_PREVIOUS_FILES``: files holding previous secrets still accepted on read,
  separated by ``os.pathsep``;
- ``MMKEY_ENTRY_ACCEPT_UNAUTHENTICATED=1``: the migration window, also serve entries
  without a MAC (after their checksum).

Every secret has at least 32 bytes. blake3 loads when a secret is made, never at
``import mmkey``.
"""

from __future__ import annotations

import enum
import hmac
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    import blake3

__all__ = [
    "ENV_ACCEPT_UNAUTHENTICATED",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "ENV_PREVIOUS_FILES",
    "FROM_ENV",
    "KEY_ID_BYTES",
    "MAC_BYTES",
    "MIN_SECRET_BYTES",
    "EntryKeyring",
    "EntrySecret",
    "FromEnv",
    "keyring_for_cache",
]

ENV_SECRET: Final = "MMKEY_ENTRY_KEY"
"""The current entry secret as text."""
ENV_SECRET_FILE: Final = "MMKEY_ENTRY_KEY_FILE"
"""A file holding the current entry secret (its bytes, exactly)."""
ENV_PREVIOUS_FILES: Final = "MMKEY_ENTRY_KEY_PREVIOUS_FILES"
"""Files holding previous secrets, still accepted on read, separated by ``os.pathsep``."""
ENV_ACCEPT_UNAUTHENTICATED: Final = "MMKEY_ENTRY_ACCEPT_UNAUTHENTICATED"
"""``1`` during a migration window: also serve entries that carry no MAC."""
MIN_SECRET_BYTES: Final = 32
"""The shortest secret accepted."""
MAC_BYTES: Final = 32
"""Length of an entry's MAC (a full BLAKE3 output)."""
KEY_ID_BYTES: Final = 8
"""Length of the id that names the secret an entry's MAC was made with."""

_MAC_CONTEXT = "mmkey 2026-11-30 entry MAC key v1"
_ID_CONTEXT = "mmkey 2026-11-30 entry secret id v1"
_SECRET_HINT = (
    "generate one with: head -c 32 /dev/urandom > entry.key (then MMKEY_ENTRY_KEY_FILE=entry.key)"
)


class FromEnv(enum.Enum):
    """The type of `FROM_ENV`, the default of every cache's ``keyring`` argument."""

    FROM_ENV = "from the environment"


FROM_ENV: Final = FromEnv.FROM_ENV
"""Read the keyring from ``MMKEY_ENTRY_KEY_FILE`` / ``MMKEY_ENTRY_KEY`` (none if both unset)."""


def _secret_bytes(secret: object, what: str) -> bytes:
    if isinstance(secret, str):
        raw = secret.encode("utf-8", "surrogatepass")
    elif isinstance(secret, (bytes, bytearray, memoryview)):
        raw = bytes(secret)
    else:
        raise TypeError(f"{what} must be bytes or str, got {type(secret).__name__}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{what} has {len(raw)} bytes; entry secrets need at least {MIN_SECRET_BYTES}; "
            f"{_SECRET_HINT}"
        )
    return raw


class _Sealed:
    """Key material that shows as ``<hidden>`` in reprs, `attrs.asdict` and logs, and
    refuses to be pickled (each process loads its secret from its own environment)."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = value

    def reveal(self) -> bytes:
        """The key material itself, for the hasher only."""
        return self._value

    def __repr__(self) -> str:
        return "<hidden>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Sealed):
            return NotImplemented
        return hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(self._value)

    def __copy__(self) -> _Sealed:
        return self

    def __deepcopy__(self, memo: object) -> _Sealed:
        return self

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError(
            "entry secrets are not pickled; load the secret in each process "
            f"({ENV_SECRET_FILE} or EntryKeyring.from_secrets)"
        )


@attrs.frozen(slots=True, repr=False)
class EntrySecret:
    """One fleet secret, kept only as the MAC key derived from it and its public id.

    Build it with `EntrySecret.from_secret`; the repr shows the id, never key material.
    """

    key_id: bytes
    """The 8-byte id entries carry to name this secret (derived from it, one-way)."""
    _mac_key: _Sealed = attrs.field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes | str) -> EntrySecret:
        """Derive the MAC key and the id from `secret` (at least 32 bytes; text is UTF-8)."""
        import blake3

        raw = _secret_bytes(secret, "the entry secret")
        mac_key = blake3.blake3(raw, derive_key_context=_MAC_CONTEXT).digest()
        key_id = blake3.blake3(raw, derive_key_context=_ID_CONTEXT).digest(KEY_ID_BYTES)
        return cls(key_id, _Sealed(mac_key))

    def hasher(self, max_threads: int = 1) -> blake3.blake3:
        """A fresh BLAKE3 hasher in keyed mode under this secret's MAC key."""
        import blake3

        return blake3.blake3(key=self._mac_key.reveal(), max_threads=max_threads)

    def __repr__(self) -> str:
        return f"EntrySecret(key_id={self.key_id.hex()})"


@attrs.frozen(slots=True)
class EntryKeyring:
    """The secrets a cache signs and verifies entries with, and its mixed-fleet policy.

    Entries are written with `current`; reads accept `current` and every `previous` secret
    (rotation without a cold cache). Entries without a MAC are served only while
    `accept_unauthenticated` is set (a migration window); otherwise they are misses,
    counted as forged.
    """

    current: EntrySecret
    previous: tuple[EntrySecret, ...] = ()
    accept_unauthenticated: bool = False
    _by_id: dict[bytes, EntrySecret] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        secrets = (self.current, *self.previous)
        for secret in secrets:
            if not isinstance(secret, EntrySecret):
                raise TypeError(
                    f"keyring secrets must be EntrySecret, got {type(secret).__name__}; "
                    "use EntryKeyring.from_secrets(current, *previous)"
                )
        by_id = {secret.key_id: secret for secret in secrets}
        if len(by_id) != len(secrets):
            raise ValueError("a keyring holds each secret once; a previous secret repeats one")
        if not isinstance(self.accept_unauthenticated, bool):
            raise TypeError("accept_unauthenticated must be a bool")
        object.__setattr__(self, "_by_id", by_id)

    @classmethod
    def from_secrets(
        cls, current: bytes | str, *previous: bytes | str, accept_unauthenticated: bool = False
    ) -> EntryKeyring:
        """A keyring writing with `current`, also reading entries made with `previous` ones."""
        return cls(
            EntrySecret.from_secret(current),
            tuple(EntrySecret.from_secret(secret) for secret in previous),
            accept_unauthenticated,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EntryKeyring | None:
        """The keyring the ``MMKEY_ENTRY_*`` variables describe; None if no secret is set.

        A variable that is set but unusable (empty, unreadable file, short secret, both
        secret variables at once) raises `ValueError` naming the variable, never the secret.
        """
        env = os.environ if environ is None else environ
        path, text = env.get(ENV_SECRET_FILE), env.get(ENV_SECRET)
        previous_paths = env.get(ENV_PREVIOUS_FILES, "")
        accept = env.get(ENV_ACCEPT_UNAUTHENTICATED, "0")
        if accept not in ("0", "1"):
            raise ValueError(f"{ENV_ACCEPT_UNAUTHENTICATED} must be 0 or 1, got {accept!r}")
        if path is not None and text is not None:
            raise ValueError(f"set {ENV_SECRET_FILE} or {ENV_SECRET}, not both")
        if path is None and text is None:
            if previous_paths or accept == "1":
                raise ValueError(
                    f"{ENV_PREVIOUS_FILES} / {ENV_ACCEPT_UNAUTHENTICATED} need a current secret "
                    f"in {ENV_SECRET_FILE} or {ENV_SECRET}"
                )
            return None
        if path is not None:
            current = _read_secret(path, ENV_SECRET_FILE)
        else:
            assert text is not None
            current = EntrySecret.from_secret(_secret_bytes(text, ENV_SECRET))
        previous = tuple(
            _read_secret(p, ENV_PREVIOUS_FILES) for p in previous_paths.split(os.pathsep) if p
        )
        return cls(current, previous, accept == "1")

    def secret_for(self, key_id: bytes | memoryview) -> EntrySecret | None:
        """The secret named by `key_id`, or None if this keyring does not hold it."""
        return self._by_id.get(bytes(key_id))


def _read_secret(path: str, variable: str) -> EntrySecret:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(
            f"{variable}: cannot read the entry secret file {path!r} ({exc.strerror})"
        ) from None
    what = f"the entry secret file {path!r} ({variable})"
    return EntrySecret.from_secret(_secret_bytes(raw, what))


def keyring_for_cache(keyring: EntryKeyring | FromEnv | None, cache: str) -> EntryKeyring | None:
    """The keyring a cache named `cache` uses: `keyring` itself, or the environment's."""
    if keyring is FROM_ENV:
        return EntryKeyring.from_env()
    if keyring is None or isinstance(keyring, EntryKeyring):
        return keyring
    raise TypeError(
        f"{cache}(keyring=...) takes an EntryKeyring or None, got {type(keyring).__name__}; "
        "use EntryKeyring.from_secrets(secret)"
    )
