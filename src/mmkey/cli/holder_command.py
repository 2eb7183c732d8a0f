"""``mmkey holder``: a dedicated segment-holder process that lends memory to a Mooncake store.

It runs Mooncake's standalone ``mooncake_client`` in its own place (the PID stays the same,
so a supervisor stops it by PID; SIGTERM ends it). Serving processes then run as pure
clients (``MOONCAKE_GLOBAL_SEGMENT_SIZE=0``) and their entries outlive them.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

import click

from mmkey.cli._common import fail

__all__ = ["holder"]


@click.command("holder")
@click.option(
    "--master",
    envvar="MOONCAKE_MASTER",
    metavar="HOST:PORT",
    help="The Mooncake master to join [env: MOONCAKE_MASTER].",
)
@click.option(
    "--host",
    "local_hostname",
    envvar="MOONCAKE_LOCAL_HOSTNAME",
    metavar="ADDRESS",
    help="Address other processes reach this holder at [env: MOONCAKE_LOCAL_HOSTNAME; default 127.0.0.1].",
)
@click.option(
    "--global-segment-size",
    "segment",
    envvar="MOONCAKE_GLOBAL_SEGMENT_SIZE",
    metavar="SIZE",
    help="Memory lent to the store, e.g. 4GB [env: MOONCAKE_GLOBAL_SEGMENT_SIZE; default 512MB].",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=50052,
    show_default=True,
    help="The holder's own service port.",
)
@click.option(
    "--http-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve the holder's /health and /metrics on this port.",
)
@click.option(
    "--print-command", is_flag=True, help="Print the holder's command line and exit instead of running it."
)
def holder(
    master: str | None,
    local_hostname: str | None,
    segment: str | None,
    port: int,
    http_port: int | None,
    print_command: bool,
) -> None:
    """Lend memory to a Mooncake store until SIGTERM.

    Reads Mooncake's own MOONCAKE_* variables (MOONCAKE_MASTER, MOONCAKE_PROTOCOL,
    MOONCAKE_DEVICE, MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE,
    MOONCAKE_LOCAL_HOSTNAME or MOONCAKE_CONFIG_PATH); flags win.
    """
    from mmkey.cache.mooncake.config import MooncakeConfig
    from mmkey.cache.mooncake.holder import HolderSpec

    overrides: dict[str, Any] = {}
    if master:
        overrides["master_server_address"] = master
    if local_hostname:
        overrides["local_hostname"] = local_hostname
    if segment is not None:
        overrides["global_segment_size"] = segment
    try:
        config = MooncakeConfig.from_env(**overrides)
        spec = HolderSpec(
            master_server_address=config.master_server_address,
            local_hostname=config.local_hostname,
            global_segment_size=config.global_segment_size,
            port=port,
            protocol=config.protocol,
            device_name=config.device_name,
            metadata_server=config.metadata_server,
            http_port=http_port,
        )
        argv = spec.argv()
    except (TypeError, ValueError, FileNotFoundError) as exc:
        fail("holder", str(exc))
    if print_command:
        click.echo(shlex.join(argv))
        return
    click.echo(
        f"mmkey holder: lending {spec.global_segment_size / (1 << 20):.0f} MiB to the store at "
        f"{spec.master_server_address} from {spec.local_hostname}:{spec.port} (pid {os.getpid()}); "
        "stop it with SIGTERM",
        err=True,
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os.execv(argv[0], argv)
