"""Settings of the vLLM connector: keys for vLLM's identifiers, the namespace, the extra config.

Nothing here imports vLLM: `mmkey.integrations.vllm` reads `VllmConfig` and hands plain
values to these functions, so they are tested without the stack.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mmkey.cache.mooncake.config import MooncakeConfig, parse_size
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.hashing import hash_bytes, hash_tensor, identifier_digest
from mmkey.keys import MAX_NAMESPACE_CHARS, EmbeddingKey

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "ConnectorSettings",
    "StoreKind",
    "check_identifiers_are_content_hashes",
    "content_digest",
    "identifier_key",
    "identifier_keys",
    "modality_of",
    "scoped_identifier_key",
    "vllm_namespace",
]

EXTRA_CONFIG_KEYS = frozenset(
    {
        "namespace",
        "store",
        "mooncake",
        "memory_max_bytes",
        "max_pending_save_bytes",
        "max_staged_bytes",
        "producer_wait_s",
        "first_answer_wait_s",
        "save_hold_s",
    }
)
"""The keys `MMKeyECConnector` reads from ``ec_connector_extra_config``; any other is an error."""

_MODALITIES = {m.value: m for m in Modality}
_TAG_HEX = 16


class StoreKind(enum.Enum):
    """Where the connector keeps embeddings."""

    MOONCAKE = "mooncake"
    """A Mooncake store shared by every node that reaches its master (`MooncakeCache`)."""
    MEMORY = "memory"
    """A `MemoryCache` in this process: shared by the scheduler and worker sides of one
    single-process engine (tensor parallel size 1), seen by no other process."""


def modality_of(name: str) -> Modality | None:
    """The `Modality` of a vLLM modality name ("image", "video", "audio"), else ``None``.

    Other modalities (``prompt_embeds`` passthrough, model-specific ones) are not cached.
    """
    return _MODALITIES.get(name)


def content_digest(data: Mapping[str, Any]) -> MMHash | None:
    """BLAKE3 digest (an `MMHash`) of an item's processed inputs, or ``None`` if any is not a tensor.

    `data` maps field names to tensors or nested lists of them (vLLM's
    ``MultiModalKwargsItem.get_data()``). Every field's name and every tensor's dtype, shape
    and bytes are covered, in name order; a field that holds anything else (``None`` when
    vLLM left the data out) gives ``None``.
    """
    import torch

    parts: list[bytes] = []

    def add(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            parts.append(b"t" + hash_tensor(value).to_bytes(16, "little"))
            return True
        if isinstance(value, (list, tuple)):
            parts.append(b"l" + len(value).to_bytes(8, "little"))
            return all(add(v) for v in value)
        return False

    for name in sorted(data):
        parts.append(b"n" + name.encode("utf-8", "surrogatepass") + b"\x00")
        if not add(data[name]):
            return None
    if not parts:
        return None
    return hash_bytes(b"mmkey-vllm-content-v1\x00" + b"".join(parts))


def check_identifiers_are_content_hashes(
    *,
    processor_cache_gb: float,
    prefix_caching: bool,
    tower_lora: bool,
    explicit_namespace: bool,
) -> None:
    """Refuse (`ValueError`, naming the vLLM settings) setups whose identifiers are not content.

    With the multimodal processor cache off and prefix caching off, vLLM's identifiers are
    per-process counters (``renderer0-mm-<n>-image-<i>``), the same text on every instance; with
    LoRA on the vision tower they name the adapter, not its weights.
    """
    if processor_cache_gb <= 0 and not prefix_caching:
        raise ValueError(
            "MMKeyECConnector: with mm_processor_cache_gb=0 and prefix caching off, vLLM's "
            "multimodal identifiers are counters (renderer<N>-mm-<n>-...) that repeat on every "
            "instance and restart, so cached embeddings would be served for other images; set "
            "mm_processor_cache_gb > 0 (e.g. --mm-processor-cache-gb 1) or enable prefix caching "
            "(--enable-prefix-caching)"
        )
    if tower_lora and not explicit_namespace:
        raise ValueError(
            "MMKeyECConnector: enable_tower_connector_lora puts LoRA adapters on the vision "
            "tower, and vLLM's identifiers name an adapter, not its weights; set "
            "ec_connector_extra_config={'namespace': '<model and adapter version>'} (one per "
            "adapter set) or turn enable_tower_connector_lora off"
        )


def identifier_key(namespace: str, modality: Modality, identifier: str) -> EmbeddingKey:
    """The key of a vLLM identifier (an ``mm_hash`` or a caller's uuid, opaque text).

    The digest is `identifier_digest` of the text under `HashScheme.ID`: two identifiers
    never share a key, and nothing about the text is parsed or normalised.
    """
    return EmbeddingKey(namespace, modality, HashScheme.ID, identifier_digest(identifier))


_SCOPE_DOMAIN = b"mmkey/vllm-scoped-id/v1\x00"


def scoped_identifier_key(
    namespace: str, modality: Modality, identifier: str, *, cache_salt: str | None, lora: str | None
) -> EmbeddingKey:
    """The key of an item vLLM sent without its data: its identifier (a caller's uuid, say)
    within the request's tenant, vLLM's ``cache_salt``, and LoRA adapter name.

    Without either it is `identifier_key`; with one, BLAKE3-128 over a domain of its own and
    the length-framed parts, so no identifier text, salt or adapter name reaches another's key.
    """
    if cache_salt is None and lora is None:
        return identifier_key(namespace, modality, identifier)
    import blake3

    parts = [
        b"-" if part is None else b"+" + len(raw).to_bytes(8, "little") + raw
        for part in (cache_salt, lora, identifier)
        for raw in ((part or "").encode("utf-8", "surrogatepass"),)
    ]
    digest = int.from_bytes(blake3.blake3(_SCOPE_DOMAIN + b"".join(parts)).digest(16), "big")
    return EmbeddingKey(namespace, modality, HashScheme.ID, MMHash(digest))


def identifier_keys(namespace: str, modality: Modality, identifiers: Sequence[str]) -> list[EmbeddingKey]:
    """`identifier_key` of many identifiers under one namespace and modality, built together."""
    digests = [identifier_digest(identifier) for identifier in identifiers]
    return EmbeddingKey.for_digests(namespace, modality, HashScheme.ID, digests)


def vllm_namespace(model: str, revision: str | None, encoder_config: str, dtype: str) -> str:
    """The namespace of embeddings made by one vLLM model setup.

    Readable head ``vllm/<model>@<revision>/<dtype>`` (its start cut away when too long) and a
    tag: 64 bits of BLAKE3 over every part, the encoder/multimodal configuration included, so
    setups that differ in any part never share entries.
    """
    import blake3

    dtype = dtype.removeprefix("torch.")
    rev = revision or "default"
    identity = "\x00".join(("mmkey-vllm-ec-v1", model, rev, encoder_config, dtype))
    tag = blake3.blake3(identity.encode("utf-8", "surrogatepass")).hexdigest()[:_TAG_HEX]
    head = f"vllm/{model}@{rev}/{dtype}"
    room = MAX_NAMESPACE_CHARS - _TAG_HEX - 1
    if len(head) > room:
        head = head[len(head) - room :]
    return f"{head}#{tag}"


def _extra(name: str) -> str:
    return f"ec_connector_extra_config[{name!r}]"


def _check_namespace(_: object, attribute: attrs.Attribute[str | None], namespace: object) -> None:
    if namespace is None:
        return
    if not isinstance(namespace, str):
        raise TypeError(f"{_extra(attribute.name)} must be text, got {namespace!r}")
    # the key class checks length and text once, here, instead of at the first lookup
    identifier_key(namespace, Modality.IMAGE, "namespace-check")


def _store_kind(value: object) -> StoreKind:
    try:
        return StoreKind(value)
    except ValueError:
        kinds = [k.value for k in StoreKind]
        raise ValueError(f"{_extra('store')} must be one of {kinds}, got {value!r}") from None


def _mooncake_fields(value: object) -> object:
    return dict(value) if isinstance(value, Mapping) else value


def _check_mooncake(_: object, attribute: attrs.Attribute[Mapping[str, Any]], mooncake: object) -> None:
    if not isinstance(mooncake, Mapping):
        raise TypeError(
            f"{_extra(attribute.name)} must be a dict of MooncakeConfig fields, e.g. "
            f"{{'master_server_address': 'host:port'}}, got {mooncake!r}"
        )
    known = set(attrs.fields_dict(MooncakeConfig))
    bad = sorted(set(mooncake) - known)
    if bad:
        raise ValueError(
            f"{_extra(attribute.name)} has unknown fields {bad}; MooncakeConfig has {sorted(known)}"
        )


def _size_field(name: str, default: int) -> Any:
    def size(value: Any) -> int:
        try:
            bytes_ = parse_size(value, name)
        except TypeError:
            raise TypeError(
                f"{_extra(name)} must be bytes (an int) or size text like '512MB', got {value!r}"
            ) from None
        if bytes_ <= 0:
            raise ValueError(f"{_extra(name)} must be > 0, got {value!r}")
        return bytes_

    return attrs.field(default=default, converter=size)


def _seconds(value: object) -> object:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


FIRST_ANSWER_WAIT_S = 0.003
"""The default `ConnectorSettings.first_answer_wait_s`: about four times a hit's lookup,
fetch and verify on the benchmark host, far less than the engine step a deferral costs."""
MAX_FIRST_ANSWER_WAIT_S = 0.05
"""The longest `ConnectorSettings.first_answer_wait_s` (it holds up the scheduler's step)."""


def _check_first_answer_wait(_: object, attribute: attrs.Attribute[float], wait: object) -> None:
    if not isinstance(wait, float):
        raise TypeError(f"{_extra(attribute.name)} must be seconds (a number), got {wait!r}")
    if not 0 <= wait <= MAX_FIRST_ANSWER_WAIT_S:
        raise ValueError(
            f"{_extra(attribute.name)} must be within 0-{MAX_FIRST_ANSWER_WAIT_S} s, got {wait!r}"
        )


SAVE_HOLD_S = 0.05
"""The default `ConnectorSettings.save_hold_s`."""


def _check_save_hold(_: object, attribute: attrs.Attribute[float], hold: object) -> None:
    from mmkey.integrations._background_saver import MAX_HOLD_S

    if not isinstance(hold, float):
        raise TypeError(f"{_extra(attribute.name)} must be seconds (a number), got {hold!r}")
    if not 0 <= hold <= MAX_HOLD_S:
        raise ValueError(f"{_extra(attribute.name)} must be within 0-{MAX_HOLD_S} s, got {hold!r}")


def _check_wait(_: object, attribute: attrs.Attribute[float], wait: object) -> None:
    if not isinstance(wait, float):
        raise TypeError(f"{_extra(attribute.name)} must be seconds (a number), got {wait!r}")
    if not 0 <= wait <= 60:
        raise ValueError(f"{_extra(attribute.name)} must be within 0-60 s, got {wait!r}")


@attrs.frozen(slots=True, kw_only=True)
class ConnectorSettings:
    """What ``ec_connector_extra_config`` asks of `MMKeyECConnector`, checked (the errors name
    the extra config's key)."""

    namespace: str | None = attrs.field(default=None, validator=_check_namespace)
    """Overrides the namespace derived from `VllmConfig` (required without a model config)."""
    store: StoreKind = attrs.field(default=StoreKind.MOONCAKE, converter=_store_kind)
    mooncake: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_mooncake_fields, validator=_check_mooncake
    )
    """`MooncakeConfig` fields over Mooncake's ``MOONCAKE_*`` variables (these win)."""
    memory_max_bytes: int = _size_field("memory_max_bytes", 1 << 30)
    """Budget of the `MemoryCache` when ``store`` is ``"memory"``."""
    max_pending_save_bytes: int = _size_field("max_pending_save_bytes", 512 << 20)
    """Embedding bytes a worker may hold for background saves; past it, saves are dropped."""
    max_staged_bytes: int = _size_field("max_staged_bytes", 1 << 30)
    """Host bytes the scheduler side may hold of fetched, verified entries not yet loaded;
    past it, items are encoded instead."""
    producer_wait_s: float = attrs.field(default=2.0, converter=_seconds, validator=_check_wait)
    """How long a consumer waits for items a producer said it encoded (``ec_transfer_params``)
    to appear in the store, before encoding them itself."""
    first_answer_wait_s: float = attrs.field(
        default=FIRST_ANSWER_WAIT_S, converter=_seconds, validator=_check_first_answer_wait
    )
    """How long the scheduler's first look at a request may wait for the answers of its new
    items, where the lookup thread was idle, before deferring the request a step (0: never)."""
    save_hold_s: float = attrs.field(default=SAVE_HOLD_S, converter=_seconds, validator=_check_save_hold)
    """How long a new encoder output's save waits at most for the engine step that encoded it
    to end (the next step's start), so that writing it does not take the CPU from that step's
    forward pass (0: saves start at once)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read and check ``ec_connector_extra_config``; unknown keys are a `ValueError`."""
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"ec_connector_extra_config must be a dict, got {extra!r}")
        unknown = sorted(set(extra) - EXTRA_CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"ec_connector_extra_config has unknown keys {unknown} for MMKeyECConnector; "
                f"it reads {sorted(EXTRA_CONFIG_KEYS)}"
            )
        return cls(**extra)

    def mooncake_config(
        self, *, pure_client: bool, environ: Mapping[str, str] | None = None
    ) -> MooncakeConfig:
        """The `MooncakeConfig`: ``MOONCAKE_*`` variables, then the extra config's fields.

        A pure client (the scheduler side: it only asks what exists) lends no memory.
        Raises `ValueError` naming ``MOONCAKE_MASTER`` when no master is configured.
        """
        overrides = dict(self.mooncake)
        if pure_client:
            overrides["global_segment_size"] = 0
        try:
            return MooncakeConfig.from_env(environ, **overrides)
        except ValueError as exc:
            raise ValueError(
                f"MMKeyECConnector: {exc}; or pass ec_connector_extra_config="
                '{"mooncake": {"master_server_address": "host:port"}}, '
                'or {"store": "memory"} for one single-process engine'
            ) from None
