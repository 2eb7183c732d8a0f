"""The ``mmkey`` command: ``demo``, ``key``, ``hash``, ``bench`` and ``holder``.

The command line needs the ``cli`` extra (click and rich): ``pip install 'mmkey[cli]'``.
Without it, ``mmkey`` prints that command and exits with status 2; the library itself
never imports click or rich. Every command loads torch only when it needs it, so
``mmkey key`` answers at once. Bad input (a key that does not parse, a file that cannot
be read) is one line on stderr and exit status 2, never a traceback.

The top layer: it may import anything in mmkey, and nothing in mmkey imports it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmkey.cli._group import cli

__all__ = ["CLI_EXTRA_MISSING", "cli", "main", "missing_cli_packages"]

CLI_EXTRA_MISSING = 2
"""Exit status of ``mmkey`` when the ``cli`` extra is not installed."""

_CLI_PACKAGES = ("click", "rich")


def missing_cli_packages() -> list[str]:
    """The packages of the ``cli`` extra that this environment lacks."""
    return [name for name in _CLI_PACKAGES if importlib.util.find_spec(name) is None]


def main() -> None:
    """Entry point of the ``mmkey`` console script and ``python -m mmkey``."""
    missing = missing_cli_packages()
    if missing:
        print(
            f"mmkey: error: the command line needs {' and '.join(missing)}, from the cli extra;"
            " install it with: pip install 'mmkey[cli]'",
            file=sys.stderr,
        )
        raise SystemExit(CLI_EXTRA_MISSING)
    from mmkey.cli._group import cli

    cli(prog_name="mmkey")


if not TYPE_CHECKING:
    # hidden from type checkers, so a misspelt name stays a type error

    def __getattr__(name: str) -> object:
        if name == "cli":
            from mmkey.cli._group import cli

            return cli
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
