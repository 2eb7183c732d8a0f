"""Names a package exports but imports only when first used (PEP 562), so that importing the
package stays cheap. Imports nothing of mmkey."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], homes: Mapping[str, str], names: Iterable[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for `package`.

    Each name in `homes` is imported from the submodule ``package + "." + homes[name]`` on
    first use and kept in `namespace` (the package's ``globals()``); `names` (its ``__all__``)
    are listed by ``dir()`` and the documentation before they are loaded.
    """
    listed = frozenset(names)

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | listed)

    return __getattr__, __dir__
