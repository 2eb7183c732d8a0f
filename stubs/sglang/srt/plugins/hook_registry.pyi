from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, NamedTuple

class HookSource(NamedTuple):
    plugin_name: str
    dist_name: str | None

class HookType(Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"

class HookRegistry:
    _hooks: ClassVar[dict[str, list[tuple[HookType, Callable[..., Any], HookSource | None]]]]
    _patched: ClassVar[set[str]]
    @classmethod
    def register(
        cls,
        target: str,
        hook: Callable[..., Any],
        hook_type: HookType = ...,
        *,
        source: HookSource | None = None,
    ) -> None: ...
    @classmethod
    def apply_hooks(cls) -> None: ...
    @classmethod
    def reset(cls) -> None: ...
