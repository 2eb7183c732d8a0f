"""A dedicated segment holder: Mooncake's standalone ``mooncake_client`` lending memory.

Entries of a Mooncake store live in the memory segment of the process that holds them; when
that process exits, its entries vanish for everyone. Serving processes that run as pure
clients (``global_segment_size=0``) beside long-lived holder processes keep every entry
through a restart of the serving processes. `HolderSpec` describes one holder and builds
the command line of Mooncake's ``mooncake_client`` binary (shipped in the binding's wheel);
``mmkey holder`` runs it. Nothing here imports mooncake.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from typing import Any

import attrs

from mmkey.cache.mooncake._net import check_address_field

__all__ = ["DEFAULT_HOLDER_PORT", "HOLDER_BINARY", "HolderSpec", "find_holder_binary"]

HOLDER_BINARY = "mooncake_client"
"""Name of Mooncake's standalone client binary, inside the ``mooncake`` package."""

DEFAULT_HOLDER_PORT = 50052
"""The holder's own service port when none is given (Mooncake's default)."""


def find_holder_binary() -> str | None:
    """Path of the real ``mooncake_client`` binary (the wheel's, not its Python launcher).

    Looks inside the installed ``mooncake`` package first (the launcher script there only
    execs that binary), then next to ``sys.executable`` and on PATH.
    """
    try:
        spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, HOLDER_BINARY)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    here = shutil.which(HOLDER_BINARY, path=os.path.dirname(sys.executable))
    return here or shutil.which(HOLDER_BINARY)


def _text(_: object, attribute: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise TypeError(f"HolderSpec.{attribute.name} must be non-empty text without spaces, got {value!r}")


def _optional_port(_: object, attribute: attrs.Attribute[int | None], value: Any) -> None:
    if value is not None:
        _port(_, attribute, value)


def _port(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HolderSpec.{attribute.name} must be a port number (int), got {value!r}")
    if not 1 <= value <= 65535:
        raise ValueError(f"HolderSpec.{attribute.name} must be in 1..65535, got {value!r}")


def _segment(_: object, attribute: attrs.Attribute[int], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"HolderSpec.{attribute.name} must be a byte count (int), got {value!r}; read size "
            "text like '512MB' with mmkey.cache.mooncake.config.parse_size()"
        )
    if value <= 0:
        raise ValueError(
            f"HolderSpec.{attribute.name} must be > 0: a holder exists to lend memory "
            f"(got {value!r}; serving processes are the pure clients, with 0)"
        )


@attrs.frozen(slots=True, kw_only=True)
class HolderSpec:
    """One segment-holder process: which master it joins and how much memory it lends.

    Field names follow `mmkey.MooncakeConfig` (Mooncake's own); ``port`` is the holder's
    service port and ``http_port``, when set, serves its ``/health`` and ``/metrics``.
    """

    master_server_address: str = attrs.field(validator=check_address_field)
    local_hostname: str = attrs.field(default="127.0.0.1", validator=_text)
    global_segment_size: int = attrs.field(default=512 << 20, validator=_segment)
    port: int = attrs.field(default=DEFAULT_HOLDER_PORT, validator=_port)
    protocol: str = attrs.field(default="tcp", validator=_text)
    device_name: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    metadata_server: str = attrs.field(default="P2PHANDSHAKE", validator=_text)
    http_port: int | None = attrs.field(default=None, validator=_optional_port)

    def argv(self, binary: str | None = None) -> list[str]:
        """The holder's command line; ``FileNotFoundError`` (naming the install) without a binary."""
        path = binary or find_holder_binary()
        if path is None:
            raise FileNotFoundError(
                f"{HOLDER_BINARY} not found: it ships with the Mooncake binding; pip install "
                "'mmkey[mooncake-cpu]' (or 'mmkey[mooncake]' on NVIDIA machines)"
            )
        args = [
            path,
            f"--host={self.local_hostname}",
            f"--port={self.port}",
            f"--master_server_address={self.master_server_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.global_segment_size}",
            f"--protocol={self.protocol}",
        ]
        if self.device_name:
            args.append(f"--device_names={self.device_name}")
        if self.http_port is not None:
            args += ["--enable_http_server=true", f"--http_port={self.http_port}"]
        return args
