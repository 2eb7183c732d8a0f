"""The connector's scheduler side: fetches a request's items off the scheduler's step into
staged host memory (`Stager`), claims an item only once it is staged, and plans each step's
loads and saves (`MMKeyECMetadata`, the only vLLM class it needs at run time)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from mmkey.cache.protocol import EmbeddingCache
from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.integrations._common import Counters
from mmkey.integrations.vllm._metadata import LoadItem, MMKeyECMetadata
from mmkey.integrations.vllm._settings import ConnectorSettings, content_digest, identifier_key, modality_of
from mmkey.integrations.vllm._staging import Staged, Stager, StagerCounts
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

_MAX_TRACKED = 4096
_WAIT_MARGIN_S = 0.5
"""Added to the store's timeout: how long a request waits for its fetches at most."""
_RETRY_EVERY_S = 0.02
"""How often a consumer asks again for an item a producer announced."""
_PARAMS_KEY = "mmkey"
_MAX_ANNOUNCED = 1024


@attrs.define(slots=True)
class _RequestState:
    """What the scheduler side tracks of one request."""

    names: set[str] = attrs.field(factory=set)
    """Identifiers of its items this side asked about."""
    announced: frozenset[str] = frozenset()
    """Key texts a producer said it encoded for this request (``ec_transfer_params``)."""
    saved: set[str] = attrs.field(factory=set)
    """Key texts this side planned to save for this request (announced when it finishes)."""
    since: float | None = None
    """When the request was first deferred for its fetches (monotonic); ``None`` when not."""
    last_retry: float = 0.0
    answered: int = -1
    """The stager's answer count when `since` was last set."""
    waited_out: bool = False
    """The request waited its longest once; it is not deferred again."""


class SchedulerSide:
    """The scheduler hooks of `MMKeyECConnector` and what they track (see the connector).

    `stage`: whether this side stages items at all (the connector's scheduler role); without
    it every item is a miss and nothing is fetched. `consumer`/`producer`: the connector's
    role in a disaggregated setup; `warn` logs a store fault at a limited rate.
    """

    def __init__(
        self,
        cache: EmbeddingCache,
        namespace: str,
        settings: ConnectorSettings,
        *,
        stage: bool,
        consumer: bool,
        producer: bool,
        counts: Counters,
        warn: Callable[[str, str], None],
    ) -> None:
        self._namespace = namespace
        self._settings = settings
        self._consumer = consumer
        self._producer = producer
        self._counts = counts
        self._stager: Stager | None = None
        if stage:
            self._stager = Stager(
                cache,
                fetch=consumer,
                max_bytes=settings.max_staged_bytes,
                on_error=lambda message: warn("lookup", message),
            )
        self._digests: OrderedDict[str, MMHash] = OrderedDict()
        self._keys: OrderedDict[tuple[str, Modality], EmbeddingKey] = OrderedDict()
        self._requests: dict[str, _RequestState] = {}
        self._users: dict[str, set[str]] = {}
        self._shipped: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, LoadItem] = {}
        self._saves: dict[str, EmbeddingKey] = {}
        self._lookup_wait = _store_timeout(cache) + _WAIT_MARGIN_S

    def key(self, identifier: str, modality: Modality) -> EmbeddingKey:
        """The key of an item: by its content digest once seen with processed inputs, else by
        vLLM's identifier."""
        digest = self._digests.get(identifier)
        if digest is not None:
            return EmbeddingKey(self._namespace, modality, HashScheme.BLAKE3, digest)
        return identifier_key(self._namespace, modality, identifier)

    def stager_counts(self) -> StagerCounts | None:
        """The stager's own counts (``None`` where this side stages nothing)."""
        return None if self._stager is None else self._stager.counts()

    def close(self) -> None:
        """Stop the stager's fetches and drop what it staged."""
        if self._stager is not None:
            self._stager.close()

    def _key_of(self, feature: MultiModalFeatureSpec, modality: Modality) -> EmbeddingKey:
        """The key of a feature: the digest of its processed inputs (computed once per
        identifier and remembered), else its identifier's."""
        identifier = feature.identifier
        memo = (identifier, modality)
        if identifier not in self._digests and feature.data is not None:
            digest = content_digest(feature.data.get_data())
            if digest is not None:
                self._digests[identifier] = digest
                self._keys.pop(memo, None)  # an identifier key made before the data was seen
                if len(self._digests) > _MAX_TRACKED:
                    self._digests.popitem(last=False)
        key = self._keys.get(memo)
        if key is None:
            key = self._keys[memo] = self.key(identifier, modality)
            if len(self._keys) > _MAX_TRACKED:
                self._keys.popitem(last=False)
        return key

    def _state_of(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(announced=_announced(request))
            self._requests[request.request_id] = state
        return state

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start fetching the request's items ahead of ``num_computed_tokens``; ``False`` (vLLM
        tries again next step) while any is unanswered, for at most the store's timeout, or
        ``producer_wait_s`` for items a producer announced but the store does not hold yet."""
        stager = self._stager
        if stager is None:
            return True
        state = self._state_of(request)
        waiting = False
        waiting_for_producer = False
        for index, feature in enumerate(request.mm_features):
            modality = modality_of(feature.modality)
            position = feature.mm_position
            if modality is None or position.offset + position.length <= num_computed_tokens:
                continue
            identifier = feature.identifier
            if identifier in self._shipped:
                continue  # in vLLM's encoder cache already (or encoded there if it was evicted)
            known = stager.state(identifier) if identifier in state.names else None
            if known is Staged.STAGED or (known is Staged.MISSING and not state.announced):
                continue  # answered: the common case of a later step, no key work
            key = self._key_of(feature, modality)
            staged = stager.want(identifier, key, request.get_num_encoder_embeds(index))
            if identifier not in state.names:
                state.names.add(identifier)
                self._users.setdefault(identifier, set()).add(request.request_id)
                if staged is Staged.MISSING:  # missing for an earlier request: ask again
                    stager.retry(identifier)
                    staged = Staged.PENDING
            if staged is Staged.PENDING:
                waiting = True
            elif staged is Staged.MISSING and key.to_key() in state.announced:
                waiting = waiting_for_producer = True
                now = time.monotonic()
                if now - state.last_retry >= _RETRY_EVERY_S:
                    state.last_retry = now
                    stager.retry(identifier)
        if not waiting or state.waited_out:
            state.since = None
            return True
        now = time.monotonic()
        answered = stager.answered()
        if state.since is None:
            self._counts.add(deferred=1)
        if state.since is None or answered != state.answered:
            state.since = now  # the wait is bounded from the last answer, each call is bounded
            state.answered = answered
        limit = self._settings.producer_wait_s if waiting_for_producer else self._lookup_wait
        if now - state.since < max(limit, self._lookup_wait):
            return False
        self._counts.add(waited_out=1)
        state.waited_out = True  # waited once: the rest is encoded here, never deferred again
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Whether ``identifier``'s entry is staged here: fetched, verified, of the right size.

        Never calls the store: items not asked for by `ensure_cache_available` are misses.
        """
        stager = self._stager
        return stager is not None and stager.state(identifier) is Staged.STAGED

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Hand a staged item to this step's loads (consumers); plan the save of an item to
        encode (producers)."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        stager = self._stager
        if stager is not None and stager.state(identifier) is Staged.STAGED:
            if self._consumer:
                tensor = stager.take(identifier)
                if tensor is not None:
                    self._loads[identifier] = LoadItem(identifier, tensor)
                    self._shipped[identifier] = None
                    if len(self._shipped) > _MAX_TRACKED:
                        self._shipped.popitem(last=False)
            return
        modality = modality_of(feature.modality)
        if self._producer and modality is not None:
            key = self._key_of(feature, modality)
            self._saves[identifier] = key
            self._state_of(request).saved.add(key.to_key())

    def build_connector_meta(self) -> MMKeyECMetadata:
        """This step's loads (staged tensors, handed over) and saves."""
        meta = MMKeyECMetadata(tuple(self._loads.values()), dict(self._saves))
        self._loads.clear()
        self._saves.clear()
        return meta

    def _forget(self, request_id: str, identifier: str) -> None:
        users = self._users.get(identifier)
        if users is None:
            return
        users.discard(request_id)
        if not users:
            del self._users[identifier]
            if self._stager is not None:
                self._stager.release(identifier)
            self._shipped.pop(identifier, None)

    def update_state_after_free(self, request: Request, index: int) -> None:
        """vLLM freed an item of ``request``: release what is staged for it alone."""
        state = self._requests.get(request.request_id)
        identifier = request.mm_features[index].identifier
        if state is not None and identifier in state.names:
            state.names.discard(identifier)
            self._forget(request.request_id, identifier)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's staged items. A producer announces the keys it encoded for
        the request in its ``ec_transfer_params`` (``{"mmkey": {"encoded": [key, ...]}}``), so
        a consumer handed them waits for those saves instead of encoding again."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        for identifier in state.names:
            self._forget(request.request_id, identifier)
        if self._producer and state.saved:
            return False, {_PARAMS_KEY: {"encoded": sorted(state.saved)}}
        return False, None


def _announced(request: Request) -> frozenset[str]:
    """Key texts a producer announced in the request's ``ec_transfer_params`` (others ignored)."""
    params = getattr(request, "ec_transfer_params", None)
    if not isinstance(params, dict):
        return frozenset()
    ours = params.get(_PARAMS_KEY)
    encoded = ours.get("encoded") if isinstance(ours, dict) else None
    if not isinstance(encoded, list):
        return frozenset()
    return frozenset(k for k in encoded[:_MAX_ANNOUNCED] if isinstance(k, str))


def _store_timeout(cache: EmbeddingCache) -> float:
    """How long one store call may take (the cache's configured timeout), 0.5 s if unknown."""
    config = getattr(cache, "config", None)
    for name in ("timeout",):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.5
