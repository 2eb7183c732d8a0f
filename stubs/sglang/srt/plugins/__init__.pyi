from collections.abc import Callable
from typing import Any

PLATFORM_PLUGINS_GROUP: str
GENERAL_PLUGINS_GROUP: str
_plugins_loaded: bool

def load_plugins_by_group(
    group: str, excluded_dists: set[str] | None = None
) -> dict[str, tuple[Callable[[], Any], str | None]]: ...
def load_plugins() -> None: ...
