"""The ``mmkey`` command group (needs click, from the ``cli`` extra)."""

from __future__ import annotations

import click

from mmkey.cli.bench import bench
from mmkey.cli.demo.command import demo
from mmkey.cli.hashfiles import hash_files
from mmkey.cli.holder_command import holder
from mmkey.cli.key_command import key

__all__ = ["cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmkey", prog_name="mmkey")
def cli() -> None:
    """Typed, round-tripping cache keys and strict embedding caches for multimodal serving."""


cli.add_command(demo)
cli.add_command(key)
cli.add_command(hash_files)
cli.add_command(bench)
cli.add_command(holder)
