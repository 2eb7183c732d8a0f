"""SGLang's encoder processes started by ``multiprocessing`` use mmkey's store too.

SGLang 0.5.23 runs general plugins in its launcher only. The encode server starts its other
processes with the ``spawn`` method, and they never load plugins: the TP ranks above 0
(``target=launch_encoder`` in ``sglang.srt.disaggregation.encoder.runtime`` and in its gRPC
server ``...encoder.grpc_server``) and the DP workers (``target=launch_dp_worker`` in
``...encoder.runtime``). Each of them builds its own embedding store, so without help they
would build SGLang's own Mooncake backend while rank 0 builds mmkey's.

`cover_spawned_encoders` replaces each of those names, in the module that passes it as a
process target, with a function of this module of the same name. ``spawn`` pickles a target
by reference, so the child imports this module, runs `mmkey.integrations.sglang.register_plugin`
and then SGLang's original entry point with the same arguments. SGLang's function is left in
place where it is defined (``...encoder.server.launch_encoder``).

The spawning modules are patched as soon as they are imported (a finder on ``sys.meta_path``
wraps their loader), or at once if they already are. A name that is missing (another SGLang
version) is skipped with a debug log; nothing here raises into SGLang.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import attrs

__all__ = [
    "GRPC_MODULE",
    "RUNTIME_MODULE",
    "SERVER_MODULE",
    "SPAWN_TARGETS",
    "PatchAfterImport",
    "SpawnTarget",
    "cover_spawned_encoders",
    "launch_dp_worker",
    "launch_encoder",
    "original_of",
]

SERVER_MODULE = "sglang.srt.disaggregation.encoder.server"
"""Where SGLang defines ``launch_encoder``, the entry point of an encoder TP rank."""
RUNTIME_MODULE = "sglang.srt.disaggregation.encoder.runtime"
"""Starts the TP ranks of the HTTP encode server and its DP workers."""
GRPC_MODULE = "sglang.srt.disaggregation.encoder.grpc_server"
"""Starts the TP ranks of the gRPC encode server."""

logger: logging.Logger = logging.getLogger(__name__)

_originals: dict[tuple[str, str], Callable[..., Any]] = {}
"""SGLang's function behind each name replaced in this process, by (module, name)."""


def launch_encoder(*args: Any, **kwargs: Any) -> Any:
    """A spawned encoder TP rank: mmkey's plugin, then SGLang's ``launch_encoder(*args, **kwargs)``."""
    _register_backend()
    return original_of(SERVER_MODULE, "launch_encoder")(*args, **kwargs)


def launch_dp_worker(*args: Any, **kwargs: Any) -> Any:
    """A spawned encoder DP worker: mmkey's plugin, then SGLang's ``launch_dp_worker(*args, **kwargs)``."""
    _register_backend()
    return original_of(RUNTIME_MODULE, "launch_dp_worker")(*args, **kwargs)


@attrs.frozen(slots=True)
class SpawnTarget:
    """A name that `module` passes as a process target, and the function that replaces it."""

    module: str
    name: str
    replacement: Callable[..., Any]


SPAWN_TARGETS: tuple[SpawnTarget, ...] = (
    SpawnTarget(RUNTIME_MODULE, "launch_encoder", launch_encoder),
    SpawnTarget(RUNTIME_MODULE, "launch_dp_worker", launch_dp_worker),
    SpawnTarget(GRPC_MODULE, "launch_encoder", launch_encoder),
)
"""Every process target of SGLang's encode server that builds an embedding store."""


def original_of(module: str, name: str) -> Callable[..., Any]:
    """SGLang's function `name` of `module` (imported if needed), also where this module replaced it."""
    value: Any = getattr(importlib.import_module(module), name)
    if any(value is t.replacement for t in SPAWN_TARGETS):
        value = _originals[(module, name)]
    return value  # type: ignore[no-any-return]


def cover_spawned_encoders() -> None:
    """Make the processes SGLang's encode server spawns register mmkey's backend first.

    Patches the spawning modules already imported, and the others when they are imported.
    Calling it again changes nothing; it never raises.
    """
    try:
        for name in sorted({t.module for t in SPAWN_TARGETS}):
            module = sys.modules.get(name)
            if module is not None:
                _patch(module)
        if not any(isinstance(f, PatchAfterImport) and f.patch is _patch for f in sys.meta_path):
            sys.meta_path.insert(0, PatchAfterImport({t.module for t in SPAWN_TARGETS}, _patch))
    except Exception:
        logger.debug("mmkey: SGLang's spawned encoder processes are not covered", exc_info=True)


def _patch(module: ModuleType) -> None:
    """Replace the targets `module` spawns with ours; skip (debug log) a name it lacks."""
    for target in SPAWN_TARGETS:
        if target.module != module.__name__:
            continue
        current = getattr(module, target.name, None)
        if current is target.replacement:
            continue
        if not callable(current):
            logger.debug("mmkey: %s has no function %s; its processes are left as they are", target.module, target.name)
            continue
        _originals[(target.module, target.name)] = current
        setattr(module, target.name, target.replacement)
        logger.debug("mmkey: processes that %s starts with %s load mmkey's plugin", target.module, target.name)


def _register_backend() -> None:
    """`register_plugin` in a spawned process; a failure is logged and SGLang goes on."""
    try:
        from mmkey.integrations.sglang import register_plugin

        register_plugin()
    except Exception:
        logger.exception("mmkey: the SGLang plugin failed in a spawned encoder process; it keeps SGLang's store")


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: it has the named modules found by the finders after
    it and calls `patch` on each right after it is executed (imported or reloaded)."""

    def __init__(self, modules: set[str] | frozenset[str], patch: Callable[[ModuleType], None]) -> None:
        self.modules = frozenset(modules)
        self.patch = patch
        self._finding: set[str] = set()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """The spec the other finders give `fullname`, its loader wrapped when it is named."""
        if fullname not in self.modules or fullname in self._finding:
            return None  # not ours, or asked again by a finder we asked (no loop between two)
        self._finding.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            self._finding.discard(fullname)
        if isinstance(spec, ModuleSpec) and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec

    def _find_elsewhere(self, fullname: str, path: Any, target: ModuleType | None) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec  # type: ignore[no-any-return]
        return None

    def __repr__(self) -> str:
        return f"PatchAfterImport({sorted(self.modules)})"


class _PatchingLoader(importlib.abc.Loader):
    """A module's own loader, and `patch` once the module has executed; the rest is the loader's."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create: Callable[[ModuleSpec], ModuleType | None] | None = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception:
            logger.warning("mmkey: patching %s after its import failed", module.__name__, exc_info=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

