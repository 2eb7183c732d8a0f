"""Entry authentication: the fleet secret behind the keyed MAC that stored entries carry.

A store reachable by many processes (Mooncake has no access control) lets anyone write a
well-formed entry under any key. With an `EntryKeyring`, every entry a cache writes carries
a BLAKE3 keyed MAC over its header, its issue time and its payload, and a cache reads only
entries whose MAC verifies under the current secret or a previous one that has not expired.
The entry names the secret by an 8-byte id derived from it; neither the secret nor the MAC
key derived from it ever appears in a repr, a log line, an error or `~mmkey.EmbeddingCache.stats`.

A secret is exactly 32 random bytes; in a file or a variable it is written as 64 hex
digits and nothing else. Caches read the keyring from the environment when built, unless
code passes one:

- ``MMKEY_ENTRY_AUTH``: ``required`` (every cache over a shared store needs a secret, and
  serves only signed entries), ``migrate`` (also serve unsigned entries, counted, until
  ``MMKEY_ENTRY_MIGRATE_UNTIL``, an ISO-8601 UTC time) or ``off`` (no secret, no MAC).
  Unset: a secret is used when one is set, and a shared-store cache without one warns.
- ``MMKEY_ENTRY_KEY_FILE``: a file (mode 0600 or stricter) holding the current secret, or
- ``MMKEY_ENTRY_KEY``: the current secret, removed from ``os.environ`` once read (so child
  processes do not inherit it); setting both is an error;
- ``MMKEY_ENTRY_KEY_PREVIOUS``: previous secrets still accepted on read until their
  not-after time, as ``path@time`` items separated by commas (each file 0600).

blake3 loads when a secret is made, never at ``import mmkey``.
"""

from __future__ import annotations

import datetime as dt
import enum
import hmac
import logging
import os
import re
import stat
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    import blake3

__all__ = [
    "ENV_AUTH",
    "ENV_MIGRATE_UNTIL",
    "ENV_PREVIOUS",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "FROM_ENV",
    "KEY_ID_BYTES",
    "MAC_BYTES",
    "SECRET_BYTES",
    "AuthMode",
    "EntryKeyring",
    "EntrySecret",
    "FromEnv",
    "auth_mode",
    "keyring_for_cache",
    "parse_utc",
]

ENV_AUTH: Final = "MMKEY_ENTRY_AUTH"
"""``required``, ``migrate`` or ``off``; unset keeps the default (see the module doc)."""
ENV_MIGRATE_UNTIL: Final = "MMKEY_ENTRY_MIGRATE_UNTIL"
"""The ISO-8601 UTC time at which ``migrate`` stops serving unsigned entries."""
ENV_SECRET: Final = "MMKEY_ENTRY_KEY"
"""The current entry secret: 64 hex digits; removed from ``os.environ`` once read."""
ENV_SECRET_FILE: Final = "MMKEY_ENTRY_KEY_FILE"
"""A file (0600) holding the current entry secret: 64 hex digits, nothing else."""
ENV_PREVIOUS: Final = "MMKEY_ENTRY_KEY_PREVIOUS"
"""Previous secrets with their not-after times: ``path@2026-12-31T00:00:00Z,...``."""
_RETIRED_VARIABLES: Final = {
    "MMKEY_ENTRY_ACCEPT_UNAUTHENTICATED": (
        f"a migration window ends: set {ENV_AUTH}=migrate and {ENV_MIGRATE_UNTIL}=<ISO-8601 UTC time> instead"
    ),
    "MMKEY_ENTRY_KEY_PREVIOUS_FILES": (
        f"previous secrets expire: set {ENV_PREVIOUS}=<path>@<ISO-8601 UTC not-after>,... instead"
    ),
}
SECRET_BYTES: Final = 32
"""The length of every secret: 32 random bytes (64 hex digits as text)."""
MAC_BYTES: Final = 32
"""Length of an entry's MAC (a full BLAKE3 output)."""
KEY_ID_BYTES: Final = 8
"""Length of the id that names the secret an entry's MAC was made with."""

_MAC_CONTEXT = "mmkey 2026-11-30 entry MAC key v1"
_ID_CONTEXT = "mmkey 2026-11-30 entry secret id v1"
_HEX = re.compile(rb"[0-9a-fA-F]{64}")
_SECRET_HINT = (
    'make one with: (umask 077; python3 -c "import secrets; print(secrets.token_hex(32), '
    "end='')\" > entry.key), then MMKEY_ENTRY_KEY_FILE=entry.key"
)
_LOG = logging.getLogger("mmkey.cache.auth")


class AuthMode(enum.Enum):
    """What ``MMKEY_ENTRY_AUTH`` asks for."""

    REQUIRED = "required"
    """Every cache over a shared store has a secret and serves signed entries only."""
    MIGRATE = "migrate"
    """As `REQUIRED`, but unsigned entries are also served (counted) until a set time."""
    OFF = "off"
    """No secret: entries carry a checksum only."""


class FromEnv(enum.Enum):
    """The type of `FROM_ENV`, the default of every cache's ``keyring`` argument."""

    FROM_ENV = "from the environment"


FROM_ENV: Final = FromEnv.FROM_ENV
"""Read the keyring from the ``MMKEY_ENTRY_*`` variables (see the module doc)."""


def parse_utc(text: str, what: str) -> dt.datetime:
    """An ISO-8601 time with a UTC offset (``Z`` or ``+00:00``) as an aware datetime."""
    stripped = text.strip()
    if stripped.endswith(("Z", "z")):  # Python 3.10's parser does not take the Z suffix
        stripped = stripped[:-1] + "+00:00"
    try:
        when = dt.datetime.fromisoformat(stripped)
    except ValueError:
        when = None
    if when is None or when.utcoffset() != dt.timedelta(0):
        raise ValueError(
            f"{what}: cannot read {text!r} as an ISO-8601 UTC time; write e.g. 2026-12-31T00:00:00Z"
        )
    return when.astimezone(dt.timezone.utc)


def _utc(value: object, what: str) -> dt.datetime:
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{what} must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise ValueError(f"{what} must be timezone-aware, e.g. datetime(..., tzinfo=timezone.utc)")
    return value.astimezone(dt.timezone.utc)


def _secret_bytes(secret: object, what: str) -> bytes:
    """32 secret bytes from raw bytes or 64 hex digits; refuses anything else."""
    if isinstance(secret, str):
        text = secret.encode("utf-8", "surrogatepass")
        raw = _hex_secret(text, what)
    elif isinstance(secret, (bytes, bytearray, memoryview)):
        raw = bytes(secret)
        if len(raw) != SECRET_BYTES:
            raise ValueError(
                f"{what} has {len(raw)} bytes; an entry secret is exactly {SECRET_BYTES} random "
                f"bytes (or 64 hex digits as str); {_SECRET_HINT}"
            )
    else:
        raise TypeError(f"{what} must be bytes or str, got {type(secret).__name__}")
    if raw.isascii() and all(0x20 <= b < 0x7F for b in raw) or len(set(raw)) < 16:
        raise ValueError(
            f"{what} is not random bytes (it reads as text or repeats itself); a secret is "
            f"{SECRET_BYTES} random bytes, not a password; {_SECRET_HINT}"
        )
    return raw


def _hex_secret(text: bytes, what: str) -> bytes:
    if _HEX.fullmatch(text):
        return bytes.fromhex(text.decode("ascii"))
    stripped = text.strip()
    if stripped != text and _HEX.fullmatch(stripped):
        raise ValueError(
            f"{what} has white space around its 64 hex digits (a trailing newline?); a fleet "
            'must agree on the bytes: rewrite it without, e.g. printf %s "$KEY" > entry.key, '
            "or python3 -c \"print(secrets.token_hex(32), end='')\""
        )
    raise ValueError(
        f"{what} must be exactly 64 hex digits ({SECRET_BYTES} random bytes) and nothing "
        f"else, got {len(text)} characters; {_SECRET_HINT}"
    )


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
    A previous secret has a `not_after` time: from then on its entries are refused.
    """

    key_id: bytes
    """The 8-byte id entries carry to name this secret (derived from it, one-way)."""
    _mac_key: _Sealed = attrs.field(repr=False)
    not_after: dt.datetime | None = None
    """When entries made with this secret stop being accepted; None for no end."""

    @classmethod
    def from_secret(cls, secret: bytes | str, *, not_after: dt.datetime | None = None) -> EntrySecret:
        """Derive the MAC key and the id from ``secret``: exactly 32 random bytes, or those
        bytes as 64 hex digits. Passwords, short or padded secrets raise `ValueError`."""
        raw = _secret_bytes(secret, "the entry secret")
        when = None if not_after is None else _utc(not_after, "not_after")
        return cls._derive(raw, when)

    @classmethod
    def _derive(cls, raw: bytes, not_after: dt.datetime | None = None) -> EntrySecret:
        """The secret made from `raw` as the format defines it, without any policy check
        (for vectors made before secrets had a fixed form)."""
        import blake3

        mac_key = blake3.blake3(raw, derive_key_context=_MAC_CONTEXT).digest()
        key_id = blake3.blake3(raw, derive_key_context=_ID_CONTEXT).digest(KEY_ID_BYTES)
        return cls(key_id, _Sealed(mac_key), not_after)

    def expired(self, now: float) -> bool:
        """Whether ``now`` (seconds since the epoch) is past `not_after`."""
        return self.not_after is not None and now > self.not_after.timestamp()

    def hasher(self, max_threads: int = 1) -> blake3.blake3:
        """A fresh BLAKE3 hasher in keyed mode under this secret's MAC key."""
        import blake3

        return blake3.blake3(key=self._mac_key.reveal(), max_threads=max_threads)

    def __repr__(self) -> str:
        until = "" if self.not_after is None else f", not_after={self.not_after.isoformat()}"
        return f"EntrySecret(key_id={self.key_id.hex()}{until})"


@attrs.frozen(slots=True)
class EntryKeyring:
    """The secrets a cache signs and verifies entries with, and its mixed-fleet policy.

    Entries are written with ``current``; reads accept ``current`` and each ``previous`` secret
    until its ``not_after`` (rotation without a cold cache, and an end to a stolen old
    secret). Entries without a MAC are served only before ``migrate_until`` (a migration
    window, counted); otherwise they are misses, counted as forged.
    """

    current: EntrySecret
    previous: tuple[EntrySecret, ...] = ()
    migrate_until: dt.datetime | None = None
    _by_id: dict[bytes, EntrySecret] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        secrets = (self.current, *self.previous)
        for secret in secrets:
            if not isinstance(secret, EntrySecret):
                raise TypeError(
                    f"keyring secrets must be EntrySecret, got {type(secret).__name__}; "
                    "use EntryKeyring.from_secrets(current, (previous, not_after), ...)"
                )
        for secret in self.previous:
            if secret.not_after is None:
                raise ValueError(
                    f"previous secret {secret.key_id.hex()} needs a not_after time: entries "
                    "made with a rotated-out secret are accepted only until then"
                )
        by_id = {secret.key_id: secret for secret in secrets}
        if len(by_id) != len(secrets):
            raise ValueError("a keyring holds each secret once; a previous secret repeats one")
        if self.migrate_until is not None:
            object.__setattr__(self, "migrate_until", _utc(self.migrate_until, "migrate_until"))
        object.__setattr__(self, "_by_id", by_id)

    @classmethod
    def from_secrets(
        cls,
        current: bytes | str,
        *previous: tuple[bytes | str, dt.datetime],
        migrate_until: dt.datetime | None = None,
    ) -> EntryKeyring:
        """A keyring writing with ``current``, also reading entries made with each previous
        ``(secret, not_after)`` until its time, and unsigned ones before ``migrate_until``."""
        olds: list[EntrySecret] = []
        for item in previous:
            value: object = item
            if not (isinstance(value, tuple) and len(value) == 2):
                raise TypeError(
                    "previous secrets are (secret, not_after) pairs, e.g. "
                    "(old, datetime(2026, 12, 31, tzinfo=timezone.utc))"
                )
            olds.append(EntrySecret.from_secret(item[0], not_after=item[1]))
        return cls(EntrySecret.from_secret(current), tuple(olds), migrate_until)

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> EntryKeyring | None:
        """The keyring the ``MMKEY_ENTRY_*`` variables describe; None if no secret is set.

        A variable that is set but unusable (a secret that is not 64 hex digits, a file
        readable by others, both secret variables at once, a retired variable) raises
        `ValueError` naming the variable and the fix, never the secret. ``MMKEY_ENTRY_KEY``
        is removed from ``environ`` once read; in ``os.environ`` this process keeps it.
        """
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        for name, fix in _RETIRED_VARIABLES.items():
            if name in env:
                raise ValueError(f"{name} is no longer read; {fix}")
        mode = auth_mode(env)
        path = env.get(ENV_SECRET_FILE)
        if path is not None and ENV_SECRET in env:
            raise ValueError(f"set {ENV_SECRET_FILE} or {ENV_SECRET}, not both")
        current = _read_secret(path, ENV_SECRET_FILE) if path is not None else _take_env_secret(env)
        until_text = env.get(ENV_MIGRATE_UNTIL)
        previous_text = env.get(ENV_PREVIOUS, "")
        if mode is AuthMode.OFF:
            if current is not None or previous_text:
                raise ValueError(f"{ENV_AUTH}=off with an entry secret set: unset {ENV_AUTH} or the secret")
            return None
        if (mode is AuthMode.MIGRATE) != (until_text is not None):
            raise ValueError(f"{ENV_AUTH}=migrate and {ENV_MIGRATE_UNTIL}=<ISO-8601 UTC time> go together")
        if current is None:
            if previous_text or mode is AuthMode.MIGRATE:
                raise ValueError(
                    f"{ENV_PREVIOUS} / {ENV_AUTH}=migrate need a current secret in "
                    f"{ENV_SECRET_FILE} or {ENV_SECRET}"
                )
            return None
        until = None if until_text is None else parse_utc(until_text, ENV_MIGRATE_UNTIL)
        previous = tuple(_previous(item) for item in previous_text.split(",") if item.strip())
        return cls(current, previous, until)

    def secret_for(self, key_id: bytes | memoryview) -> EntrySecret | None:
        """The secret named by ``key_id``, or None if this keyring does not hold it."""
        return self._by_id.get(bytes(key_id))

    def serves_unsigned(self, now: float | None = None) -> bool:
        """Whether entries without a MAC are served at ``now`` (seconds since the epoch)."""
        if self.migrate_until is None:
            return False
        return (time.time() if now is None else now) < self.migrate_until.timestamp()


_taken_secret: EntrySecret | None = None
"""The secret this process took out of ``os.environ`` (later caches keep using it)."""


def _take_env_secret(env: MutableMapping[str, str]) -> EntrySecret | None:
    """The secret in ``MMKEY_ENTRY_KEY``, removed from `env` once read."""
    global _taken_secret
    text = env.pop(ENV_SECRET, None)
    if text is None:
        return _taken_secret if env is os.environ else None
    secret = EntrySecret._derive(_secret_bytes(text, ENV_SECRET))
    if env is os.environ:
        _taken_secret = secret
    return secret


def _forget_taken_secret() -> None:
    """Forget the secret taken from ``os.environ`` (tests that set it more than once)."""
    global _taken_secret
    _taken_secret = None


def _previous(item: str) -> EntrySecret:
    path, at, when = item.strip().rpartition("@")
    if not at or not path:
        raise ValueError(
            f"{ENV_PREVIOUS}: each item is <path>@<ISO-8601 UTC not-after>, got {item.strip()!r}"
        )
    not_after = parse_utc(when, f"{ENV_PREVIOUS} ({path})")
    secret = _read_secret(path, ENV_PREVIOUS)
    return attrs.evolve(secret, not_after=not_after)


def _read_secret(path: str, variable: str) -> EntrySecret:
    what = f"the entry secret file {path!r} ({variable})"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(4096)
    except OSError as exc:
        raise ValueError(f"{variable}: cannot read the entry secret file {path!r} ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{what} is readable or writable by group or others (mode "
            f"{stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}"
        )
    return EntrySecret._derive(_secret_bytes(raw.decode("latin-1"), what))


def auth_mode(environ: Mapping[str, str] | None = None) -> AuthMode | None:
    """The mode ``MMKEY_ENTRY_AUTH`` sets; None when it is unset."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_AUTH)
    if text is None or text == "":
        return None
    try:
        return AuthMode(text)
    except ValueError:
        raise ValueError(f"{ENV_AUTH} must be required, migrate or off, got {text[:40]!r}") from None


def keyring_for_cache(
    keyring: EntryKeyring | FromEnv | None, cache: str, *, shared: bool = False
) -> EntryKeyring | None:
    """The keyring a cache named ``cache`` uses: ``keyring`` itself, or the environment's.

    For a cache over a ``shared`` store, ``MMKEY_ENTRY_AUTH=required`` or ``migrate``
    without a secret raises `ValueError` (``keyring=None`` included: the variable is the
    fleet's policy), and no secret in the environment with the variable unset logs one
    WARNING (``keyring=None`` says so on purpose: no warning).
    """
    if keyring is FROM_ENV:
        ring = EntryKeyring.from_env()
    elif keyring is None or isinstance(keyring, EntryKeyring):
        ring = keyring
    else:
        raise TypeError(
            f"{cache}(keyring=...) takes an EntryKeyring or None, got {type(keyring).__name__}; "
            "use EntryKeyring.from_secrets(secret)"
        )
    if ring is None and shared:
        mode = auth_mode()
        if mode is AuthMode.REQUIRED or mode is AuthMode.MIGRATE:
            raise ValueError(
                f"{ENV_AUTH}={mode.value}: {cache} over a shared store needs an "
                f"entry secret: set {ENV_SECRET_FILE} to a 0600 file of 64 hex digits; "
                f"{_SECRET_HINT}"
            )
        if mode is None and keyring is FROM_ENV:
            _LOG.warning(
                "%s has no entry secret: anyone who reaches the store can write entries it "
                "will serve; set %s (or %s=off to say this is intended)",
                cache,
                ENV_SECRET_FILE,
                ENV_AUTH,
            )
    return ring
