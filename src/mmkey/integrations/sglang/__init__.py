"""SGLang integration: `MMKeyEmbeddingStore`, a verified embedding store for SGLang's global
multimodal cache (``--enable-mm-global-cache``), and the plugin that lets SGLang load it.

SGLang builds its store with no arguments, so this one configures itself from the
environment: ``MMKEY_NAMESPACE`` (required: the model, revision and preprocessing whose
embeddings it holds), the Mooncake configuration SGLang's own Mooncake backend reads
(``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or the ``MOONCAKE_*`` variables, with SGLang's
defaults; see `mmkey.integrations.sglang._store_settings`) and ``MMKEY_TIMEOUT`` (seconds one
store call may block SGLang's I/O thread, default 2). The effective configuration is logged
once at start.

Every SGLang hash text becomes an `EmbeddingKey` (see `sglang_digest`); every entry is a
self-describing mmkey entry (dtype, shape, key echo, checksum) verified on read against
the pool it lands in. Anything that does not verify, any store fault and any bad input is
``False`` (a miss for SGLang), logged at a limited rate and counted in ``stats``; no call
raises into SGLang. `MMKeyEmbeddingStore.batch_is_exist` answers from memory when every
hash it is asked was answered yes (found, stored, or read and verified) in the last second,
skipping the hop to the cache's worker lane; a stale yes costs SGLang one failed read, after
which it encodes, and a no, a failed read or a fault forgets the hash.

Data path: a new entry is written with `MooncakeCache.add_from`, in a Mooncake put session
that one client at a time can open for a key, so of encoders racing to put one image exactly
one writes it (the others keep its entry: ``True``, counted as skipped). In trusted-network
mode (``MMKEY_TRUSTED_NETWORK=1``) the pools SGLang registers are registered with Mooncake
and the session sends a header sealed over the pages, then the pages themselves; otherwise
each entry is assembled in the cache's staging buffer first. A hash the store holds already
is read back and, when it verifies, kept instead of rewritten; one that does not verify or
cannot be read back is replaced (`MooncakeCache.insert_from`). A get lands entries in the cache's own staging
buffers and copies each into its pages only after it verified (`MooncakeCache.read_into`):
Mooncake cannot cancel a transfer, so a read given up at the deadline may still land later,
and SGLang hands the pages of a missed read to other entries at once. Only the process that
does SGLang's store I/O (TP rank 0) connects.

The plugin (`register_plugin`, entry point ``mmkey`` in group ``sglang.srt.plugins``) does
nothing unless ``MMKEY_SGLANG_BACKEND`` is set to anything but ``0``: then the backend name
``mooncake`` (the only one ``--mm-global-cache-backend`` accepts) creates this store, and so
does ``mmkey``. Once opted in, nothing falls back to SGLang's unverified backend: a
configuration error (a switch value that does not plainly say on, a missing namespace, an
SGLang version outside the tested range, an encoder process that cannot be covered) is
logged at ERROR and makes the store's construction raise it, so the encoder refuses to start.
Where SGLang never runs the plugin (``SGLANG_PLUGINS`` without ``mmkey``, a plugin that failed
to load), the guard that ``mmkey-sglang-guard.pth`` installs at an opted-in interpreter's start
(``_mmkey_sglang_guard``, beside this package) makes SGLang's own backend fail to import.

The package, each module and what it may import: ``_store`` the store (the only module that
imports SGLang's ``EmbeddingStore`` and mmkey's Mooncake client; any module below);
``_plugin`` the plugin (``_spawn``, ``_store_settings``, ``_hash``); ``_spawn`` the import hook
that makes SGLang's spawned encoder processes load the plugin (the standard library, attrs
and SGLang's plugin loader only: a spawned child imports it first); ``_store_settings`` what is read
from the environment, ``_keys`` hash text to keys, ``_pools`` the registered pools,
``_recent`` the memory of recent yes answers, ``_claimed`` the single-flight claims a store
won and has not ended yet, ``_hash`` the opt-in BLAKE3 feature hash
(mmkey's core only). None imports another stack's integration, and no module imports
``_store``: SGLang reaches it through this ``__init__``, which imports nothing at run time
(each public name loads its module on first use), so a spawned child or a settings check
stays as light as its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkey._lazy import lazy_exports

if TYPE_CHECKING:
    from mmkey.integrations.sglang._keys import sglang_digest, sglang_key
    from mmkey.integrations.sglang._plugin import BACKEND_NAME, plugin_errors, register_plugin
    from mmkey.integrations.sglang._pools import REGISTRATION_ORDER
    from mmkey.integrations.sglang._store import MMKeyEmbeddingStore
    from mmkey.integrations.sglang._store_settings import (
        BACKEND_ENV,
        DEFAULT_TIMEOUT,
        HASH_ENV,
        NAMESPACE_ENV,
        TIMEOUT_ENV,
        SGLangConfigError,
        config_from_env,
        namespace_from_env,
    )

__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAME",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT",
    "HASH_ENV",
    "NAMESPACE_ENV",
    "REGISTRATION_ORDER",
    "MMKeyEmbeddingStore",
    "SGLangConfigError",
    "config_from_env",
    "namespace_from_env",
    "plugin_errors",
    "register_plugin",
    "sglang_digest",
    "sglang_key",
]

_HOMES = {
    "sglang_digest": "_keys",
    "sglang_key": "_keys",
    "BACKEND_NAME": "_plugin",
    "plugin_errors": "_plugin",
    "register_plugin": "_plugin",
    "REGISTRATION_ORDER": "_pools",
    "BACKEND_ENV": "_store_settings",
    "TIMEOUT_ENV": "_store_settings",
    "DEFAULT_TIMEOUT": "_store_settings",
    "HASH_ENV": "_store_settings",
    "NAMESPACE_ENV": "_store_settings",
    "SGLangConfigError": "_store_settings",
    "config_from_env": "_store_settings",
    "namespace_from_env": "_store_settings",
    "MMKeyEmbeddingStore": "_store",
}
"""The module of each public name, imported when the name is first used."""


if not TYPE_CHECKING:  # type checkers see the imports above, so a misspelt name stays an error
    __getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES, __all__)
