"""Small helpers shared by the commands."""

from __future__ import annotations

from typing import NoReturn

import click

from mmkey.digest import HashScheme, Modality

__all__ = ["BAD_INPUT", "fail", "modality_option_type", "scheme_option_type", "warn"]

BAD_INPUT = 2
"""Exit status for input that mmkey refuses (a bad key, an unreadable file)."""

scheme_option_type = click.Choice([s.value for s in HashScheme if s.hashes_content])
modality_option_type = click.Choice([m.value for m in Modality])


def warn(command: str, message: str) -> None:
    """Print one ``mmkey <command>: error: ...`` line on stderr."""
    click.echo(f"mmkey {command}: error: {message}", err=True)


def fail(command: str, message: str, status: int = BAD_INPUT) -> NoReturn:
    """Print one error line and exit with `status`."""
    warn(command, message)
    raise SystemExit(status)
