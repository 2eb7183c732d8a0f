"""`MooncakeConfig`: how to reach a Mooncake store, with Mooncake's own field names."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from mmkey.cache.mooncake._net import check_address_field

__all__ = [
    "ENV_TABLE",
    "FILE",
    "MMKEY_ENV",
    "MOONCAKE_ENV",
    "Env",
    "MooncakeConfig",
    "Source",
    "parse_replica_num",
    "parse_size",
    "read_fields",
    "read_json_config",
]

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(kb|mb|gb|tb|k|m|g|t|b)?", re.ASCII | re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# the protocols mooncake-transfer-engine 0.3.13.post1 knows (its mooncake_config.py,
# _KNOWN_PROTOCOLS: the transfer engine's transports and the store-only mode); which work
# depends on the build and the hardware. Matched as Mooncake's own config matches them,
# stripped and lower-cased: its C++ engine refuses "RDMA" (setup -1, unsupported_protocol).
_PROTOCOLS = frozenset(
    {
        "tcp",
        "rdma",
        "efa",
        "nvmeof",
        "nvlink",
        "nvlink_intra",
        "musa",
        "hip",
        "barex",
        "cxl",
        "ascend",
        "ub",
        "ubshmem",
        "maca",
        "sunrise_link",
        "rpc_only",
    }
)
_UNUSABLE_PROTOCOLS = {
    "rpc_only": (
        "Mooncake's store-only mode attaches no transfer engine, so it moves no entries: "
        "mooncake-transfer-engine 0.3.13.post1 crashes the process in setup when given a "
        "segment or a transfer buffer, and puts and gets nothing without one; use tcp or rdma"
    ),
}
"""Protocols Mooncake knows that no mmkey cache can work with, and why (measured)."""


def parse_size(value: int | str, field: str = "size") -> int:
    """Bytes from an int or Mooncake's size text (``"512MB"``, ``"1g"``, ``"3355443200"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{field} must be an int or size text like '512MB', got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"{field}: cannot read {value!r} as a size; write bytes or a number with "
            "a unit k/kb, m/mb, g/gb, t/tb (powers of 1024), e.g. '512MB'"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()[:1]])


def _non_negative_size(_: object, attribute: attrs.Attribute[int], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"MooncakeConfig.{attribute.name} must be a byte count (int), got {value!r}; "
            "read size text like '512MB' with mmkey.cache.mooncake.config.parse_size()"
        )
    if value < 0:
        raise ValueError(f"MooncakeConfig.{attribute.name} must be a byte count >= 0, got {value!r}")


def _positive_size(_: object, attribute: attrs.Attribute[int], value: Any) -> None:
    _non_negative_size(_, attribute, value)
    if value == 0:
        raise ValueError(f"MooncakeConfig.{attribute.name} must be > 0: it bounds one entry")


def _seconds(_: object, attribute: attrs.Attribute[float], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"MooncakeConfig.{attribute.name} must be seconds (a float), got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"MooncakeConfig.{attribute.name} must be finite and > 0, got {value!r}")


def _wait_seconds(_: object, attribute: attrs.Attribute[float], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"MooncakeConfig.{attribute.name} must be seconds (a float), got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"MooncakeConfig.{attribute.name} must be finite and >= 0 (0: off), got {value!r}")


def _text(_: object, attribute: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"MooncakeConfig.{attribute.name} must be str, got {value!r}")


def _replicas(_: object, attribute: attrs.Attribute[int], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"MooncakeConfig.replica_num must be a count (int), got {value!r}")
    if value < 1:
        raise ValueError(f"MooncakeConfig.replica_num must be >= 1, got {value!r}")


def _canonical_protocol(value: str) -> str:
    """Protocol text as Mooncake's own config reads it: stripped and lower-cased (anything
    else is left to the validator)."""
    given: object = value
    return value.strip().lower() if isinstance(given, str) else value


def _protocol(_: object, attribute: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"MooncakeConfig.protocol must be text such as 'tcp', got {value!r}")
    if value not in _PROTOCOLS:
        usable = sorted(_PROTOCOLS - _UNUSABLE_PROTOCOLS.keys())
        raise ValueError(f"MooncakeConfig.protocol must be one of {usable}, got {value!r}")
    if value in _UNUSABLE_PROTOCOLS:
        raise ValueError(f"MooncakeConfig.protocol {value!r}: {_UNUSABLE_PROTOCOLS[value]}")


@attrs.frozen(slots=True, kw_only=True)
class MooncakeConfig:
    """How to reach a Mooncake store, and how long a cache call may wait for it.

    Field names are Mooncake's own. Sizes are bytes. Timeouts are seconds: no cache
    call blocks its caller longer than `timeout` (or `setup_timeout` to connect);
    after a failure the store is left alone for `retry_after` seconds.

    Where entries live: in the memory segment (`global_segment_size`) of the process that
    wrote them, wherever the master placed them among the segments mounted at the time.
    When a process closes its cache or exits, the entries in its segment are gone for
    every reader. To keep entries across restarts of serving processes, make those pure
    clients (``global_segment_size=0``) and run dedicated holder processes that lend the
    memory and outlive them (and store more than one replica, so a holder's death loses
    nothing).
    """

    master_server_address: str = attrs.field(validator=check_address_field)
    local_hostname: str = attrs.field(default="127.0.0.1", validator=[_text, attrs.validators.min_len(1)])
    protocol: str = attrs.field(default="tcp", converter=_canonical_protocol, validator=_protocol)
    """Mooncake's transport, any case (``"RDMA"`` is ``"rdma"``), as its own config reads it."""
    device_name: str = attrs.field(default="", validator=_text)
    metadata_server: str = attrs.field(default="P2PHANDSHAKE", validator=[_text, attrs.validators.min_len(1)])
    global_segment_size: int = attrs.field(default=512 << 20, validator=_non_negative_size)
    """Memory this client lends to the store; entries written anywhere may be placed in it,
    and they vanish when this client closes (0: a pure client that holds nothing)."""
    local_buffer_size: int = attrs.field(default=128 << 20, validator=_positive_size)
    """Mooncake's transfer buffer for this client. `MooncakeCache` also sizes each of its
    transfer lanes' staging buffers from it (at most 256 MiB each, three lanes), allocated,
    faulted in and registered at construction, so that memory is resident for the cache's
    life. Not a limit on entry size: larger entries are written and read through a buffer
    of their own, up to `max_entry_size` on reads."""
    tenant_id: str = attrs.field(default="default", validator=[_text, attrs.validators.min_len(1)])
    """Mooncake's tenant (``MOONCAKE_TENANT_ID``). Not an isolation boundary: with
    mooncake-transfer-engine 0.3.13.post1, a client of one tenant reads, overwrites and
    removes the keys of another (measured against a real master). Separate tenants by
    namespace, and entries from writers without the fleet secret by `EntryKeyring`."""
    timeout: float = attrs.field(default=0.5, validator=_seconds)
    """Seconds one call may block its caller, however many transfers it takes."""
    setup_timeout: float = attrs.field(default=5.0, validator=_seconds)
    """Seconds connecting to the master (and registering staging) may take."""
    retry_after: float = attrs.field(default=1.0, validator=_seconds)
    """Seconds the store is left alone after a failure before it is tried again. Trial writes
    and probes of a quarantined holder wait twice as long after each that fails, up to 16 times
    this (each can spin a client thread until the transfer's deadline)."""
    replica_num: int = attrs.field(default=1, validator=_replicas)
    """Copies of each entry written (Mooncake's `ReplicateConfig.replica_num`), each on a
    different holder: with 2 or more, an entry survives the death of the holder of one copy."""
    trusted_network: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Trusted-network mode (``MMKEY_TRUSTED_NETWORK=1``): `MooncakeCache.register_memory`
    registers the caller's memory (e.g. SGLang's pools) so puts go straight from it. Memory
    registered with Mooncake is writable by anyone who reaches this process's transfer
    ports, so set it only where no host outside the fleet can reach them. Off: caller
    memory is never registered, entries move through this cache's staging buffers."""
    max_entry_size: int = attrs.field(default=64 << 20, validator=_positive_size)
    """The largest entry `MooncakeCache.get_embeddings` fetches (``MMKEY_MAX_ENTRY_SIZE``);
    a larger value under a key is a miss, counted as oversized, and is not transferred.
    `read_into` fetches no more than its targets can take."""
    claim_wait: float = attrs.field(default=2.0, validator=_wait_seconds)
    """Single-flight (``MMKEY_CLAIM_WAIT``): the longest a miss waits for a key another client
    claimed (is encoding) before encoding it itself, in seconds; 0 turns claims off. Near the
    encoder's p99 time per request: a claimant that dies or never writes costs a waiter this."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> MooncakeConfig:
        """Read Mooncake's own variables (``MOONCAKE_*``, named in `MOONCAKE_ENV`; ``MOONCAKE_REPLICA_NUM``
        is the name Mooncake's deployment scripts use, the binding itself reads no variable
        for it), the JSON file ``MOONCAKE_CONFIG_PATH`` names (these field names), and mmkey's
        ``MMKEY_TRUSTED_NETWORK`` (0 or 1), ``MMKEY_MAX_ENTRY_SIZE`` and ``MMKEY_CLAIM_WAIT``
        (seconds). An empty variable counts as unset. Each field, first found first
        (`read_fields` with `ENV_TABLE`)::

            field                      keyword   variable                       file   default
            Mooncake's nine fields     1         2 (MOONCAKE_*)                 3      4
            trusted_network,           1         2 (MMKEY_TRUSTED_NETWORK, ...)  -     3
              max_entry_size, claim_wait

        `ValueError` when nothing names a master."""
        env = os.environ if environ is None else environ
        path = env.get("MOONCAKE_CONFIG_PATH")
        fields = read_fields(ENV_TABLE, env, read_json_config(path) if path else None)
        fields.update(overrides)
        if "master_server_address" not in fields:
            raise ValueError(
                "no Mooncake master configured: set MOONCAKE_MASTER=host:port "
                "(or MOONCAKE_CONFIG_PATH to a JSON config file)"
            )
        if isinstance(fields.get("trusted_network"), str):
            flag = fields["trusted_network"]
            if flag not in ("0", "1"):
                raise ValueError(f"MMKEY_TRUSTED_NETWORK must be 0 or 1, got {flag!r}")
            fields["trusted_network"] = flag == "1"
        for name in ("global_segment_size", "local_buffer_size", "max_entry_size"):
            if name in fields:
                fields[name] = parse_size(fields[name], name)
        if isinstance(fields.get("claim_wait"), str):
            fields["claim_wait"] = _parse_seconds(fields["claim_wait"], "MMKEY_CLAIM_WAIT")
        if "replica_num" in fields:
            fields["replica_num"] = parse_replica_num(fields["replica_num"])
        return cls(**fields)

    def setup_args(self) -> tuple[str, str, int, int, str, str, str]:
        """The positional arguments of ``MooncakeDistributedStore.setup``."""
        return (
            self.local_hostname,
            self.metadata_server,
            self.global_segment_size,
            self.local_buffer_size,
            self.protocol,
            self.device_name,
            self.master_server_address,
        )


MOONCAKE_ENV = {
    "master_server_address": "MOONCAKE_MASTER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "tenant_id": "MOONCAKE_TENANT_ID",
    "replica_num": "MOONCAKE_REPLICA_NUM",
}
"""Mooncake's variable of each of its fields (a config file holds the same fields by name)."""
MMKEY_ENV = {
    "trusted_network": "MMKEY_TRUSTED_NETWORK",
    "max_entry_size": "MMKEY_MAX_ENTRY_SIZE",
    "claim_wait": "MMKEY_CLAIM_WAIT",
}
"""mmkey's own settings of a Mooncake cache (not Mooncake's: never in its config file)."""


@attrs.frozen(slots=True)
class Env:
    """A source of a field: the variable ``name``, when set and not empty (and, with
    ``without_file``, only where no config file is given)."""

    name: str
    without_file: bool = False


FILE: Literal["file"] = "file"
"""A source of a field: the config file's value of it, when the file has the field."""

Source = Env | Literal["file"]

ENV_TABLE: Mapping[str, Sequence[Source]] = {
    **{name: (Env(var), FILE) for name, var in MOONCAKE_ENV.items()},
    **{name: (Env(var),) for name, var in MMKEY_ENV.items()},
}
"""`MooncakeConfig.from_env`'s sources of each field, first found first."""


def read_fields(
    table: Mapping[str, Sequence[Source]], environ: Mapping[str, str], file: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Each field of ``table`` from the first of its sources that has it (fields none has are
    left out, for a default): the one reader of a Mooncake configuration from variables and
    a config file's fields (``file``, ``None`` when no file is given)."""
    fields: dict[str, Any] = {}
    for name, sources in table.items():
        for source in sources:
            if source == FILE:
                if file is not None and name in file:
                    fields[name] = file[name]
                    break
            elif environ.get(source.name) and not (source.without_file and file is not None):
                fields[name] = environ[source.name]
                break
    return fields


def read_json_config(path: str, variable: str = "MOONCAKE_CONFIG_PATH") -> dict[str, Any]:
    """The JSON object in the config file at ``path`` (named by the environment variable
    ``variable``, for the error); `ValueError` when it cannot be read or is not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{variable}={path!r}: cannot read a JSON config: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{variable}={path!r}: expected a JSON object")
    return data


def _parse_seconds(text: str, variable: str) -> float:
    """Seconds from a variable's text; `ValueError` naming the variable."""
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{variable} must be seconds such as 2 or 0.5 (0: off), got {text!r}") from None


def parse_replica_num(value: object) -> object:
    """``MOONCAKE_REPLICA_NUM`` text as an int; any other value is left to the field's check."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"MOONCAKE_REPLICA_NUM must be a whole number >= 1, got {text!r}")
    return int(text)
