"""Keeps an opted-in SGLang process off SGLang's own, unverified Mooncake embedding backend.

mmkey's SGLang plugin maps the ``mooncake`` backend to mmkey's store, but only where SGLang
loads it: ``SGLANG_PLUGINS`` without ``mmkey``, or a plugin that failed to load, leaves SGLang's
backend in place and no code of mmkey's runs to object. So mmkey's wheel ships
``mmkey-sglang-guard.pth``, which Python's ``site`` runs at the start of every interpreter of
the environment: where ``MMKEY_SGLANG_BACKEND`` opts in (set, non-empty and not ``0``), it
calls `install`, and importing SGLang's backend module then fails with an error naming the
fix unless mmkey's plugin has registered in that process. SGLang imports that module only
when it builds the backend, so the encoder refuses to start. Elsewhere it does nothing; it
imports only the standard library, and lives outside the ``mmkey`` package so that an
interpreter's start does not import mmkey.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # an interpreter's start imports no typing machinery for this module
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["SGLANG_BACKEND_MODULE", "UnguardedBackend", "install", "installed", "opted_in", "refusal"]

SGLANG_BACKEND_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_embedding_store"
"""SGLang's own Mooncake embedding store: no namespace, no checksum, no MAC."""
_SWITCH = "MMKEY_SGLANG_BACKEND"
_PLUGIN_MODULE = "mmkey.integrations.sglang._plugin"


class UnguardedBackend(ImportError):
    """SGLang's own Mooncake embedding backend was asked for where mmkey's store is opted in."""


def opted_in(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``MMKEY_SGLANG_BACKEND`` opts in: set, non-empty and not ``0``."""
    env = os.environ if environ is None else environ
    return env.get(_SWITCH, "") not in ("", "0")


def _plugin_registered() -> bool:
    plugin = sys.modules.get(_PLUGIN_MODULE)
    registered = getattr(plugin, "registered", None)
    return bool(registered()) if callable(registered) else False


def refusal(environ: Mapping[str, str] | None = None) -> str:
    """The error for an opted-in process whose SGLang would build its own backend."""
    env = os.environ if environ is None else environ
    allowed = env.get("SGLANG_PLUGINS", "")
    names = [name.strip() for name in allowed.split(",") if name.strip()]
    if names and "mmkey" not in names:
        cause = (
            f"SGLANG_PLUGINS={allowed!r} does not list 'mmkey', so SGLang never loaded mmkey's "
            f"plugin: add it (SGLANG_PLUGINS={','.join([*names, 'mmkey'])})"
        )
    else:
        cause = (
            "mmkey's SGLang plugin did not register in this process (SGLang logs "
            "'Failed to load plugin mmkey' or 'Failed to execute general plugin: mmkey' with "
            "the cause; check that mmkey is installed in SGLang's environment)"
        )
    return (
        f"mmkey: {_SWITCH}={env.get(_SWITCH, '')!r} opts in to mmkey's verified embedding store, "
        f"but SGLang was about to build its own unverified Mooncake backend: {cause}, "
        f"or unset {_SWITCH} to run SGLang's backend"
    )


class _Guard:
    """Refuses to find `SGLANG_BACKEND_MODULE` until mmkey's plugin has registered (a meta
    path finder needs only `find_spec`; no ``importlib.abc`` base, which costs milliseconds)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == SGLANG_BACKEND_MODULE and opted_in() and not _plugin_registered():
            raise UnguardedBackend(refusal(), name=fullname)
        return None


def installed() -> bool:
    """Whether the guard is on ``sys.meta_path`` in this interpreter."""
    return any(isinstance(finder, _Guard) for finder in sys.meta_path)


def install() -> None:
    """Put the guard first on ``sys.meta_path`` (once); for interpreters whose start runs no
    ``.pth`` file of mmkey's, call it from ``sitecustomize`` or the launcher."""
    if not installed():
        sys.meta_path.insert(0, _Guard())
