"""The ``mmkey`` command: ``demo``, ``key``, ``hash``, ``bench`` and ``holder``.

Every command loads torch only when it needs it, so ``mmkey key`` answers at once.
Bad input (a key that does not parse, a file that cannot be read) is one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import click

from mmkey.cli.bench import bench
from mmkey.cli.demo import demo
from mmkey.cli.hashfiles import hash_files
from mmkey.cli.holder import holder
from mmkey.cli.keys import key

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmkey", prog_name="mmkey")
def cli() -> None:
    """Typed, round-tripping cache keys and strict embedding caches for multimodal serving."""


cli.add_command(demo)
cli.add_command(key)
cli.add_command(hash_files)
cli.add_command(bench)
cli.add_command(holder)


def main() -> None:
    """Entry point of the ``mmkey`` console script and ``python -m mmkey``."""
    cli(prog_name="mmkey")
