"""What the SGLang integration reads from the environment, checked before any store is built.

The switch ``MMKEY_SGLANG_BACKEND``: unset, empty or ``0`` leaves SGLang alone; any other
value opts in. ``1``, ``true``, ``yes``, ``on`` and ``mmkey`` (any case) are the values that
say so plainly; any other value (``false``, ``off``, a typo) still opts in, and is a
configuration error that stops the encoder: a value that may mean "off" never leaves an
encoder silently on SGLang's unverified backend. ``MMKEY_SGLANG_HASH``: empty for SGLang's
own 64-bit hashes, ``blake3`` for BLAKE3-128.

The Mooncake store is configured as SGLang's own Mooncake embedding backend configures it
(SGLang 0.5.23, ``MooncakeStoreConfig``), with SGLang's defaults: the JSON file named by
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` when set, otherwise ``MOONCAKE_MASTER``,
``MOONCAKE_PROTOCOL`` (default ``rdma``; any case, as Mooncake's own config reads it),
``MOONCAKE_DEVICE``, ``MOONCAKE_TE_META_DATA_SERVER`` (default ``P2PHANDSHAKE``),
``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (default 4 GiB), ``MOONCAKE_TENANT_ID``; the local host name
from ``MOONCAKE_LOCAL_HOSTNAME``, then ``LOCAL_HOSTNAME``, then the file, then ``localhost``
(an empty variable is skipped, where SGLang would pass it on and Mooncake refuse it). mmkey
adds ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_REPLICA_NUM``, ``MMKEY_TIMEOUT`` and the
``MMKEY_*`` settings `MooncakeConfig.from_env` reads.
``MOONCAKE_CLIENT`` (a standalone ``mooncake_client``) is not used by SGLang's embedding
backend either: the store talks to the master itself, so a master is required.

Each Mooncake field, first found first (`mmkey.cache.mooncake.config.read_fields`; "no file":
read only where ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` is unset)::

    field                  1                          2                  3      4
    master_server_address  file                       MOONCAKE_MASTER    -      (required)
                                                      (no file)
    device_name,           file                       MOONCAKE_* (no     SGLang's default
      metadata_server,                                file)
      global_segment_size,
      tenant_id
    protocol               file                       MOONCAKE_PROTOCOL  SGLang's default
    local_hostname         MOONCAKE_LOCAL_HOSTNAME    LOCAL_HOSTNAME     file   localhost
    local_buffer_size,     MOONCAKE_LOCAL_BUFFER_SIZE file               MooncakeConfig's
      replica_num          / MOONCAKE_REPLICA_NUM

mmkey's own settings (``MMKEY_TRUSTED_NETWORK``, ...) come from `MooncakeConfig.from_env`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import attrs

from _mmkey_sglang_guard import opted_in  # the guard of mmkey-sglang-guard.pth reads the switch the same way
from mmkey.cache.mooncake.config import (
    FILE,
    MOONCAKE_ENV,
    Env,
    MooncakeConfig,
    Source,
    parse_replica_num,
    parse_size,
    read_fields,
    read_json_config,
)
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.errors import InvalidKey, SGLangConfigError
from mmkey.keys import EmbeddingKey

__all__ = [
    "BACKEND_ENV",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT",
    "HASH_ENV",
    "NAMESPACE_ENV",
    "SGLANG_CONFIG_ENV",
    "TESTED_SGLANG",
    "SGLangConfigError",
    "StoreSettings",
    "check_sglang_version",
    "config_from_env",
    "hash_mode",
    "namespace_from_env",
    "opted_in",
    "settings_from_env",
    "switch_problem",
]

BACKEND_ENV = "MMKEY_SGLANG_BACKEND"
"""Any non-empty value but ``0`` makes SGLang's ``mooncake`` backend mmkey's store."""
HASH_ENV = "MMKEY_SGLANG_HASH"
"""``blake3``: SGLang hashes multimodal features with BLAKE3-128 and keys use 128 bits."""
NAMESPACE_ENV = "MMKEY_NAMESPACE"
"""Names what produced the embeddings (model, revision, preprocessing); required."""
TIMEOUT_ENV = "MMKEY_TIMEOUT"
"""Seconds one store call may block SGLang's I/O thread (default `DEFAULT_TIMEOUT`)."""
DEFAULT_TIMEOUT = 2.0
SGLANG_CONFIG_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
"""SGLang's Mooncake config file (JSON, Mooncake's field names)."""
TESTED_SGLANG = ((0, 5, 23), (0, 5, 24))
"""SGLang versions this integration is tested with: from the first, below the second."""

_ON = frozenset({"1", "true", "yes", "on", "mmkey"})
_HASHES = {"": HashScheme.SGLANG, "sglang": HashScheme.SGLANG, "blake3": HashScheme.BLAKE3}
# SGLang 0.5.23's defaults (sglang.srt.environ) for its Mooncake backend
_SGLANG_DEFAULTS: dict[str, Any] = {
    "local_hostname": "localhost",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": "4gb",
    "protocol": "rdma",
    "device_name": "",
    "tenant_id": "default",
}
_SGLANG_TABLE: dict[str, tuple[Source, ...]] = {
    # SGLang reads its file, or else these variables (an empty one skipped)
    **{
        name: (FILE, Env(MOONCAKE_ENV[name], without_file=True))
        for name in (
            "master_server_address",
            "device_name",
            "metadata_server",
            "global_segment_size",
            "tenant_id",
        )
    },
    "protocol": (FILE, Env("MOONCAKE_PROTOCOL")),  # SGLang: the variable where the file has none
    # SGLang: these win over the file (SGLang also passes on an empty MOONCAKE_LOCAL_HOSTNAME,
    # which Mooncake's setup refuses: -600, "local_hostname is empty"; mmkey skips it)
    "local_hostname": (Env("MOONCAKE_LOCAL_HOSTNAME"), Env("LOCAL_HOSTNAME"), FILE),
    # mmkey's additions
    "local_buffer_size": (Env("MOONCAKE_LOCAL_BUFFER_SIZE"), FILE),
    "replica_num": (Env("MOONCAKE_REPLICA_NUM"), FILE),
}
"""The sources of each Mooncake field, first found first (the module doc has the table)."""


def switch_problem(environ: Mapping[str, str] | None = None) -> SGLangConfigError | None:
    """The error of an opted-in switch whose value does not plainly say "on", else None."""
    env = os.environ if environ is None else environ
    value = env.get(BACKEND_ENV, "")
    if value in ("", "0") or value.strip().lower() in _ON:
        return None
    return SGLangConfigError(
        f"{BACKEND_ENV}={value!r} is not a value mmkey reads as on: set {BACKEND_ENV}=1 to "
        f"use mmkey's verified store, or unset it (or 0) to keep SGLang's own backend"
    )


def hash_mode(environ: Mapping[str, str] | None = None) -> HashScheme:
    """The scheme of SGLang's feature hashes: `HashScheme.SGLANG` (64-bit, SGLang's own) or
    `HashScheme.BLAKE3` with ``MMKEY_SGLANG_HASH=blake3``; `SGLangConfigError` otherwise."""
    env = os.environ if environ is None else environ
    value = env.get(HASH_ENV, "")
    scheme = _HASHES.get(value.strip().lower())
    if scheme is None:
        raise SGLangConfigError(
            f"{HASH_ENV}={value!r}: set {HASH_ENV}=blake3 for 128-bit feature hashes, or leave "
            "it unset for SGLang's own 64-bit hashes"
        )
    return scheme


def namespace_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``MMKEY_NAMESPACE``, checked; `SGLangConfigError` naming the variable when it is
    missing or not a valid namespace."""
    env = os.environ if environ is None else environ
    namespace = env.get(NAMESPACE_ENV, "")
    if not namespace:
        raise SGLangConfigError(
            f"{NAMESPACE_ENV} is not set: name the model, revision and preprocessing whose "
            f"embeddings this SGLang server stores, e.g. {NAMESPACE_ENV}=qwen2.5-vl-7b@main"
        )
    try:
        EmbeddingKey(namespace, Modality.IMAGE, HashScheme.SGLANG, MMHash(0))
    except InvalidKey as exc:
        raise SGLangConfigError(f"{NAMESPACE_ENV}={namespace!r}: {exc}") from None
    return namespace


def check_sglang_version(version: str) -> None:
    """`SGLangConfigError` unless `version` is in `TESTED_SGLANG`, read as pip reads the
    extra's ``>=low,<high`` (PEP 440): ``0.5.23rc1`` and ``0.5.23.dev0`` come before
    ``0.5.23`` and are refused; ``0.5.23.post1`` and ``0.5.23+cu128`` are in."""
    if not _in_tested_range(version):
        low, high = TESTED_SGLANG
        raise SGLangConfigError(
            f"SGLang {version} is outside the versions mmkey's SGLang integration is tested "
            f"with ({_dotted(low)} up to, not including, {_dotted(high)}): install "
            f"sglang=={_dotted(low)} (pip install 'mmkey[sglang]'), or unset {BACKEND_ENV} "
            "to run SGLang's own backend"
        )


def _in_tested_range(version: str) -> bool:
    """Whether pip takes `version` for the extra's bound ``>=low,<high`` of `TESTED_SGLANG`
    (PEP 440; an installed pre-release inside the range counts, as pip counts it)."""
    from packaging.specifiers import SpecifierSet  # SGLang's own dependency
    from packaging.version import InvalidVersion, Version

    low, high = TESTED_SGLANG
    try:
        parsed = Version(version.strip())
    except InvalidVersion:
        return False
    return SpecifierSet(f">={_dotted(low)},<{_dotted(high)}").contains(parsed, prereleases=True)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@attrs.frozen(slots=True)
class StoreSettings:
    """A Mooncake configuration and where it came from (for the start-up log)."""

    config: MooncakeConfig
    source: str
    """``file <path>`` or ``environment``."""
    notes: tuple[str, ...] = ()
    """Settings read but not used (e.g. ``MOONCAKE_CLIENT``)."""

    def describe(self) -> str:
        """One line: the effective configuration."""
        c = self.config
        text = (
            f"master={c.master_server_address} protocol={c.protocol} device={c.device_name!r} "
            f"local_hostname={c.local_hostname} metadata_server={c.metadata_server} "
            f"global_segment_size={c.global_segment_size} local_buffer_size={c.local_buffer_size} "
            f"tenant_id={c.tenant_id} replica_num={c.replica_num} timeout={c.timeout}s "
            f"claim_wait={c.claim_wait}s "
            f"(from {self.source})"
        )
        return text + "".join(f"; {note}" for note in self.notes)


def config_from_env(environ: Mapping[str, str] | None = None) -> MooncakeConfig:
    """The Mooncake configuration SGLang's own Mooncake embedding backend would use, with
    mmkey's timeout; `SGLangConfigError` naming the fix for anything it cannot use."""
    return settings_from_env(environ).config


def settings_from_env(environ: Mapping[str, str] | None = None) -> StoreSettings:
    """`config_from_env` and where it came from."""
    env = os.environ if environ is None else environ
    notes: list[str] = []
    path = env.get(SGLANG_CONFIG_ENV)
    data = None if path is None else _read_file(path)
    if data is not None:
        if "master_server_address" not in data and "client_server_address" not in data:
            raise SGLangConfigError(
                f"{SGLANG_CONFIG_ENV}={path!r}: the file names no master_server_address; "
                "add the Mooncake master's host:port"
            )
        client = data.get("client_server_address")
        source = f"file {path}"
    else:
        if not env.get("MOONCAKE_MASTER") and not env.get("MOONCAKE_CLIENT"):
            raise SGLangConfigError(
                "no Mooncake master configured: set MOONCAKE_MASTER=host:port (or "
                f"{SGLANG_CONFIG_ENV} to a JSON config file), as for SGLang's own backend"
            )
        client = env.get("MOONCAKE_CLIENT")
        source = "environment"
        if env.get("MOONCAKE_CONFIG_PATH"):
            notes.append(f"MOONCAKE_CONFIG_PATH not read (SGLang's backend reads {SGLANG_CONFIG_ENV})")
    fields: dict[str, Any] = {**_SGLANG_DEFAULTS, **read_fields(_SGLANG_TABLE, env, data)}
    if client:
        if not fields.get("master_server_address"):
            raise SGLangConfigError(
                f"MOONCAKE_CLIENT={client!r} names a standalone mooncake_client, which the "
                "embedding store does not use (nor does SGLang's own): set MOONCAKE_MASTER="
                "host:port (or master_server_address in the config file)"
            )
        notes.append(f"MOONCAKE_CLIENT={client} not used (the store talks to the master)")
    fields["tenant_id"] = str(fields.get("tenant_id") or "").strip() or "default"
    fields["timeout"] = _timeout(env)
    try:
        for name in ("global_segment_size", "local_buffer_size"):
            if name in fields:
                fields[name] = parse_size(fields[name], name)
        if "replica_num" in fields:
            fields["replica_num"] = parse_replica_num(fields["replica_num"])
        # mmkey's own MMKEY_* settings of a Mooncake cache come from MooncakeConfig.from_env,
        # with every Mooncake field above given: nothing of Mooncake's is read twice
        mmkey_only = {k: v for k, v in env.items() if k.startswith("MMKEY_")}
        return StoreSettings(MooncakeConfig.from_env(mmkey_only, **fields), source, tuple(notes))
    except (TypeError, ValueError) as exc:
        raise SGLangConfigError(f"Mooncake configuration ({source}): {exc}") from None


def _read_file(path: str) -> dict[str, Any]:
    try:
        return read_json_config(path, SGLANG_CONFIG_ENV)
    except ValueError as exc:
        raise SGLangConfigError(str(exc)) from None


def _timeout(env: Mapping[str, str]) -> float:
    text = env.get(TIMEOUT_ENV, "")
    try:
        timeout = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        raise SGLangConfigError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds, e.g. 2.0") from None
    if not (math.isfinite(timeout) and timeout > 0):
        raise SGLangConfigError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return timeout
