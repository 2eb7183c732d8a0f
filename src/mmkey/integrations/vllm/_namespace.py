"""The cache namespace of a vLLM setup (`namespace_from_vllm_config`), and the check that its
item identifiers can key a shared cache (`check_identifiers`). Imports no part of vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mmkey.integrations.vllm._connector_settings import check_identifiers_are_content_hashes, vllm_namespace
from mmkey.integrations.vllm._identity import checkpoint_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["check_identifiers", "namespace_from_vllm_config"]


def namespace_from_vllm_config(vllm_config: VllmConfig) -> str:
    """The namespace of a vLLM setup: what the model is, its multimodal config and dtype.

    A local checkpoint is named by its contents (``checkpoint_identity``: config, processor
    configs, vision weights), so the same checkpoint at two paths shares entries and changed
    vision weights or preprocessing do not; a hub name by name and revision. Also covered:
    vLLM's hash of the encoder configuration, the processor kwargs (but ``device``, which
    says where preprocessing runs, not what it does), quantization and ``hf_overrides``.

    Raises `ValueError` when the config has no model (a model-less test): pass
    ``"namespace"`` in ``ec_connector_extra_config`` then.
    """
    model_config = vllm_config.model_config
    if model_config is None:
        raise ValueError(
            "MMKeyECConnector: this VllmConfig has no model config to derive the cache "
            "namespace from; set ec_connector_extra_config={'namespace': '<model@revision>'}"
        )
    mm_config = model_config.multimodal_config
    encoder = "no-multimodal-config"
    if mm_config is not None:
        kwargs = {k: v for k, v in (mm_config.mm_processor_kwargs or {}).items() if k != "device"}
        encoder = f"{mm_config.compute_hash()}|{json.dumps(kwargs, sort_keys=True, default=repr)}"
    extras = {
        "quantization": getattr(model_config, "quantization", None),
        "hf_overrides": getattr(model_config, "hf_overrides", None),
    }
    encoder += "|" + json.dumps(extras, sort_keys=True, default=repr)
    model, revision = str(model_config.model), model_config.revision
    identity = checkpoint_identity(model)
    if identity is not None:
        model, revision = _architecture(model), f"blake3-{identity[:16]}"
        encoder += f"|checkpoint={identity}"
    return vllm_namespace(model, revision, encoder, str(model_config.dtype))


def _architecture(directory: str) -> str:
    """The first architecture ``config.json`` names (the namespace's readable head)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
        return str(config["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "local-checkpoint"


def check_identifiers(vllm_config: VllmConfig, *, explicit_namespace: bool) -> None:
    """Refuse setups whose vLLM identifiers are not content hashes (see the settings)."""
    model_config = vllm_config.model_config
    mm_config = model_config.multimodal_config if model_config is not None else None
    if mm_config is None:
        return  # no multimodal model: nothing is keyed by identifier
    cache_config = getattr(vllm_config, "cache_config", None)
    lora_config = getattr(vllm_config, "lora_config", None)
    check_identifiers_are_content_hashes(
        processor_cache_gb=float(getattr(mm_config, "mm_processor_cache_gb", 1.0)),
        prefix_caching=bool(getattr(cache_config, "enable_prefix_caching", True)),
        tower_lora=bool(getattr(lora_config, "enable_tower_connector_lora", False)),
        explicit_namespace=explicit_namespace,
    )
