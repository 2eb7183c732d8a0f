"""The spawn hook: SGLang's encoder processes started by ``multiprocessing`` use mmkey's store too.

SGLang 0.5.23 runs general plugins in its launcher only. The encode server starts its other
processes with the ``spawn`` method, and they never load plugins: the TP ranks above 0
(``target=launch_encoder`` in ``sglang.srt.disaggregation.encoder.runtime`` and in its gRPC
server ``...encoder.grpc_server``) and the DP workers (``target=launch_dp_worker`` in
``...encoder.runtime``). Each of them builds its own embedding store, so without help they
would build SGLang's own Mooncake backend while rank 0 builds mmkey's.

`cover_spawned_encoders` replaces each of those names, in the module that passes it as a
process target, with a function of this module of the same name. ``spawn`` pickles a target
by reference, so the child imports this module, runs SGLang's plugin loader (and so
mmkey's plugin, as the patched SGLang below does) and then SGLang's original entry point
with the same arguments. SGLang's function is left in place where it is defined
(``...encoder.server.launch_encoder``).

The spawning modules are patched as soon as they are imported (a finder on ``sys.meta_path``
wraps their loader), or at once if they already are. A target that already loads SGLang's
plugins itself (an SGLang with ``load_plugins()`` at the top of ``launch_encoder`` and
``launch_dp_worker``, e.g. with ``patches/sglang-0.5.23-load-plugins.patch``) is left as it
is. What cannot be covered is recorded (`problems`) and logged at ERROR; the store refuses
to start on it: a missing name (another SGLang version), or a spawning module imported
without the patch (`check_coverage`: a finder placed ahead of mmkey's on ``sys.meta_path``
loaded it). Nothing here raises into SGLang's plugin loader.
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
    "check_coverage",
    "clear_problems",
    "cover_spawned_encoders",
    "loads_plugins_itself",
    "launch_dp_worker",
    "launch_encoder",
    "original_of",
    "problems",
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
_problems: dict[tuple[str, str], str] = {}
"""What could not be covered in this process, by (module, name)."""


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
    except Exception as exc:
        _problem(
            ("*", "*"),
            f"SGLang's spawned encoder processes could not be covered ({type(exc).__name__}: {exc})",
        )


def problems() -> list[str]:
    """What could not be covered in this process so far (each also logged at ERROR)."""
    return list(_problems.values())


def clear_problems() -> None:
    """Forget the recorded problems (a process that loads the plugin again)."""
    _problems.clear()


def loads_plugins_itself(function: object) -> bool:
    """Whether `function` calls SGLang's ``load_plugins`` itself (a patched SGLang)."""
    code = getattr(function, "__code__", None)
    return code is not None and "load_plugins" in code.co_names


def check_coverage() -> list[str]:
    """Every problem so far, plus each spawning module imported in this process whose target
    is neither mmkey's nor loads plugins itself: it was loaded past mmkey's finder (a finder
    placed ahead of it on ``sys.meta_path``), so its processes would build SGLang's store."""
    for target in SPAWN_TARGETS:
        module = sys.modules.get(target.module)
        if module is None or (target.module, target.name) in _problems:
            continue
        current = getattr(module, target.name, None)
        if current is target.replacement or loads_plugins_itself(current):
            continue
        if not callable(current):
            _missing(target)
            continue
        ahead = ", ".join(repr(f) for f in sys.meta_path[: _finder_index()]) or "none, mmkey's is gone"
        _problem(
            (target.module, target.name),
            f"{target.module} was imported without mmkey's patch of {target.name} (finders ahead "
            f"of mmkey's on sys.meta_path: {ahead}), "
            "so the processes it starts would build SGLang's unverified store: apply "
            "patches/sglang-0.5.23-load-plugins.patch to SGLang, or load the plugin "
            "before that finder is installed",
        )
    return problems()


def _finder_index() -> int:
    for i, finder in enumerate(sys.meta_path):
        if isinstance(finder, PatchAfterImport) and finder.patch is _patch:
            return i
    return len(sys.meta_path)


def _problem(where: tuple[str, str], text: str) -> None:
    if where not in _problems:
        _problems[where] = text
        logger.error("mmkey: %s", text)


def _missing(target: SpawnTarget) -> None:
    _problem(
        (target.module, target.name),
        f"{target.module} has no function {target.name}: this SGLang starts its encoder "
        "processes differently from 0.5.23, and mmkey cannot make them use its store; "
        "install sglang==0.5.23 or unset MMKEY_SGLANG_BACKEND",
    )


def _patch(module: ModuleType) -> None:
    """Replace the targets `module` spawns with ours; record a name it lacks as a problem,
    and leave a target that loads plugins itself alone."""
    for target in SPAWN_TARGETS:
        if target.module != module.__name__:
            continue
        current = getattr(module, target.name, None)
        if current is target.replacement:
            continue
        if not callable(current):
            _missing(target)
            continue
        if loads_plugins_itself(current):
            logger.debug(
                "mmkey: %s.%s loads SGLang's plugins itself; not replaced", target.module, target.name
            )
            continue
        _originals[(target.module, target.name)] = current
        setattr(module, target.name, target.replacement)
        logger.debug(
            "mmkey: processes that %s starts with %s load mmkey's plugin", target.module, target.name
        )


def _register_backend() -> None:
    """In a spawned process, what the launcher did before it: SGLang's plugin loader (which
    runs mmkey's plugin, recording its own configuration errors so the store there refuses
    to start on them, then applies the registered hooks), as the patched SGLang does."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


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
        create: Callable[[ModuleSpec], ModuleType | None] | None = getattr(
            self._loader, "create_module", None
        )
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception:
            logger.warning("mmkey: patching %s after its import failed", module.__name__, exc_info=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
