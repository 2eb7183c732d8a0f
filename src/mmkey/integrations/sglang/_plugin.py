"""The SGLang plugin: `register_plugin` (entry point ``mmkey`` in group ``sglang.srt.plugins``).

It does nothing unless ``MMKEY_SGLANG_BACKEND`` is set to anything but ``0``: then the backend
name ``mooncake`` (the only one ``--mm-global-cache-backend`` accepts) creates mmkey's store,
and so does ``mmkey``. Once opted in, nothing falls back to SGLang's unverified backend: a
configuration error (a switch value that does not plainly say on, a missing namespace, an
SGLang version outside the tested range, an encoder process that cannot be covered) is
logged at ERROR and makes the store's construction raise it, so the encoder refuses to start.
Where SGLang does not run it at all, the guard of ``_mmkey_sglang_guard`` (installed at an
opted-in interpreter's start) keeps SGLang's own backend from loading, until `registered`.
Imports no part of SGLang until it runs, and never the store's module.
"""

from __future__ import annotations

import logging
import os

from _mmkey_sglang_guard import installed
from mmkey.digest import HashScheme
from mmkey.integrations.sglang._spawn import check_coverage, cover_spawned_encoders
from mmkey.integrations.sglang._store_settings import (
    BACKEND_ENV,
    SGLangConfigError,
    check_sglang_version,
    hash_mode,
    namespace_from_env,
    opted_in,
    settings_from_env,
    switch_problem,
)

__all__ = [
    "BACKEND_NAME",
    "guard_problems",
    "plugin_errors",
    "refuse_on_plugin_errors",
    "register_plugin",
    "registered",
]

BACKEND_NAME = "mmkey"
"""The backend name this store is registered under besides ``mooncake``."""

_MODULE = __name__.rpartition(".")[0]
"""Where SGLang finds the store: the package's public path."""
_CLASS = "MMKeyEmbeddingStore"

logger: logging.Logger = logging.getLogger(__name__)

_plugin_errors: list[str] | None = None
"""The configuration errors the plugin found in this process (None: it has not opted in)."""


def registered() -> bool:
    """Whether the plugin opted in and mapped SGLang's backends to mmkey's store in this
    process (the guard that ``mmkey-sglang-guard.pth`` installs asks this)."""
    return _plugin_errors is not None


def plugin_errors() -> list[str]:
    """What stops mmkey's store from starting in this process: the plugin's configuration
    errors, and the encoder processes it could not cover (empty when it did not opt in)."""
    if _plugin_errors is None:
        return []
    return [*_plugin_errors, *check_coverage(), *guard_problems()]


def guard_problems() -> list[str]:
    """The missing guard, where this opted-in interpreter started without it on
    ``sys.meta_path``: the processes such a layout starts without mmkey's plugin would build
    SGLang's own backend unchallenged."""
    if installed():
        return []
    return [
        f"the guard of mmkey-sglang-guard.pth is not on sys.meta_path: Python runs .pth files "
        f"only from a site directory at the interpreter's start with {BACKEND_ENV} already set, "
        "so with pip install --target, a PYTHONPATH-only layout, a zipapp, python -S or the "
        "switch set after the start, a process SGLang starts without mmkey's plugin builds "
        "SGLang's unverified backend: install mmkey into the environment's site-packages "
        f"(pip install, not --target), set {BACKEND_ENV} before Python starts and drop -S, or "
        "run 'import _mmkey_sglang_guard; _mmkey_sglang_guard.install()' at the interpreter's "
        "start (sitecustomize.py, or the launcher's first line)"
    ]


def refuse_on_plugin_errors() -> None:
    """Raise `SGLangConfigError` naming every error `plugin_errors` reports, if any."""
    errors = plugin_errors()
    if errors:
        raise SGLangConfigError(
            "mmkey's SGLang embedding store refuses to start (the encoder must not run on an "
            f"unverified store once {BACKEND_ENV} opts in): " + " | ".join(errors)
        )


def register_plugin() -> None:
    """SGLang general plugin: with ``MMKEY_SGLANG_BACKEND`` set to anything but ``0``,
    register `MMKeyEmbeddingStore` as the ``mooncake`` and ``mmkey`` embedding store
    backends, and make the encoder processes SGLang spawns (TP ranks above 0, DP workers) do
    the same before they start (``cover_spawned_encoders``), and give the hashes a request
    supplies a key space of their own (``_caller_hashes``), and make the embedding cache's I/O
    thread wait for work instead of polling every 1 ms (``_io_loop``); otherwise do nothing.

    Configuration errors (the switch's value, ``MMKEY_NAMESPACE``, ``MMKEY_SGLANG_HASH``, the
    Mooncake configuration, SGLang's version) are logged at ERROR and recorded: the store's
    construction then raises them, so the encoder refuses to start. Raises only when
    SGLang's backend registry cannot be reached.
    """
    global _plugin_errors
    if not opted_in():
        return
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    for name in ("mooncake", BACKEND_NAME):
        EmbeddingStoreFactory.register_backend(name, _MODULE, _CLASS)
    errors: list[str] = []
    problem = switch_problem()
    if problem is not None:
        errors.append(str(problem))
    for check in (_check_version, namespace_from_env, hash_mode, settings_from_env):
        try:
            check()
        except SGLangConfigError as exc:
            errors.append(str(exc))
    _plugin_errors = errors
    for error in errors:
        logger.error("mmkey: %s", error)
    cover_spawned_encoders()
    if not errors:
        from mmkey.integrations.sglang import _caller_hashes

        _caller_hashes.install()  # a caller's hashes never name the server's own entries
        from mmkey.integrations.sglang import _io_loop

        _io_loop.install()  # the cache's I/O thread waits for work instead of polling
    if not errors and hash_mode() is HashScheme.BLAKE3:
        from mmkey.integrations.sglang._hash import install

        install()
    logger.info(
        "mmkey: --mm-global-cache-backend mooncake now creates %s.%s (%s=%s)%s",
        _MODULE,
        _CLASS,
        BACKEND_ENV,
        os.environ.get(BACKEND_ENV, ""),
        "; it will refuse to start: see the errors above" if errors else "",
    )


def _check_version() -> None:
    import sglang

    check_sglang_version(str(getattr(sglang, "__version__", "unknown")))
