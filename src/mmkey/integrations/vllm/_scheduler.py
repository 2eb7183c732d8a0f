"""The connector's scheduler side: fetches a request's items off the scheduler's step into
staged host memory (`Stager`), says an item is cached only once it is staged, and plans each
step's loads and saves (`MMKeyECMetadata`, the only vLLM class it needs at run time).

Single-flight (an encoding role over a cache with claims on): a missing item is claimed off the
step; a request whose item another claimant is encoding waits for its entry, at most
``max(lookup wait, claim_wait)`` from its first deferral. A request claims in key order: one
that won a key past a key it waits for gives that claim back, so two requests that each won
what the other waits for never wait on each other."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from mmkey._log import Counters
from mmkey.cache.protocol import EmbeddingCache
from mmkey.digest import HashScheme, Modality
from mmkey.entry.auth import EntryKeyring
from mmkey.integrations.vllm._announce import announce, read_announcement
from mmkey.integrations.vllm._connector_settings import (
    ConnectorSettings,
    content_digest,
    identifier_key,
    modality_of,
    scoped_identifier_key,
)
from mmkey.integrations.vllm._metadata import LoadItem, MMKeyECMetadata, MMKeyECWorkerMetadata
from mmkey.integrations.vllm._stager import Staged, Stager, StagerCounts, claim_wait_of
from mmkey.keys import EmbeddingKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

_MAX_TRACKED = 4096
_WAIT_MARGIN_S = 0.5
"""Added to the store's timeout: how long a request waits for its fetches at most."""
_RETRY_FIRST_S = 0.02
"""How soon a consumer first asks again for an item a producer announced; each retry
waits twice as long as the one before, up to `_RETRY_LONGEST_S` (or a 16th of the wait)."""
_RETRY_LONGEST_S = 0.25
_MAX_RETRIES = 32
"""Retries of a request's announced items at most: then they are encoded here."""
_HELD_RETRY_LONGEST_S = 0.1
"""The longest pause between two looks at items claimed elsewhere (from `_RETRY_FIRST_S`,
doubling): a waiter sees an entry at most this long after it landed."""


@attrs.define(slots=True)
class _RequestState:
    """What the scheduler side tracks of one request."""

    names: set[str] = attrs.field(factory=set)
    """Identifiers of its items this side asked about."""
    announced: frozenset[str] = frozenset()
    """Key texts of this namespace a producer said it encoded for this request
    (``ec_transfer_params``, verified where the fleet has an entry secret)."""
    saved: set[str] = attrs.field(factory=set)
    """Key texts this side planned to save for this request (announced when it finishes)."""
    keys: dict[int, EmbeddingKey] = attrs.field(factory=dict)
    """The key of each of its items (by index), computed once from the item's data."""
    lookup_deadline: float | None = None
    """When its wait for fetches ends (monotonic), set when it is first deferred and never
    moved; ``None`` until then."""
    producer_deadline: float | None = None
    """When its wait for announced items ends, set at the same time, never moved."""
    retries: int = 0
    """Rounds of retries of its announced items so far (at most `_MAX_RETRIES`)."""
    next_retry: float = 0.0
    claim_deadline: float | None = None
    """When its wait for items claimed elsewhere ends, set at the same time, never moved."""
    held: set[str] = attrs.field(factory=set)
    """Identifiers of its items it waits for (claimed elsewhere), until each is answered."""
    held_retries: int = 0
    next_held_retry: float = 0.0
    waited_out: bool = False
    """The request waited its longest once; it is not deferred again."""


class SchedulerSide:
    """The scheduler hooks of `MMKeyECConnector` and what they track (see the connector).

    `stage`: whether this side stages items at all (the connector's scheduler role); without
    it every item is a miss and nothing is fetched. `consumer`/`producer`: the connector's
    role in a disaggregated setup; `warn` logs a store fault at a limited rate. `keyring`:
    the fleet's entry secrets, which sign and verify announcements (``None``: unsigned).
    `clock` (monotonic) times every wait, `wall_clock` (the epoch's) the secrets' expiry.
    A producer over a cache with claims on (`claim_wait_of` > 0) claims what it encodes.
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
        keyring: EntryKeyring | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._namespace = namespace
        self._settings = settings
        self._consumer = consumer
        self._producer = producer
        self._counts = counts
        self._keyring = keyring
        self._clock = clock
        self._wall_clock = wall_clock
        self._stager: Stager | None = None
        self._lookup_wait = _store_timeout(cache) + _WAIT_MARGIN_S
        claim_wait = claim_wait_of(cache) if stage and producer else 0.0
        self._claim_wait = max(self._lookup_wait, claim_wait) if claim_wait else 0.0
        """How long a request waits at most for items claimed elsewhere (0.0: claims off)."""
        if stage:
            self._stager = Stager(
                cache,
                fetch=consumer,
                max_bytes=settings.max_staged_bytes,
                on_error=lambda message: warn("lookup", message),
                claims=claim_wait > 0,
                # a won claim outlives every wait for it that began before it was won
                hold_s=self._claim_wait + self._lookup_wait,
                clock=clock,
            )
        self._requests: dict[str, _RequestState] = {}
        self._users: dict[str, set[str]] = {}
        self._item_keys: dict[str, EmbeddingKey] = {}
        """The key of each identifier its live requests share."""
        self._conflicted: set[str] = set()
        """Identifiers live requests name with different keys (one uuid, two images):
        neither claimed nor saved until the last of those requests lets go."""
        self._shipped: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, LoadItem] = {}
        self._saves: dict[str, EmbeddingKey] = {}
        self._retry_longest = max(_RETRY_LONGEST_S, settings.producer_wait_s / 16)

    def key(self, identifier: str, modality: Modality) -> EmbeddingKey:
        """The key of an item vLLM sends without its data, for a request with no
        ``cache_salt`` and no LoRA adapter: its identifier's. (An item with data is keyed by
        the digest of that data, every time.)"""
        return identifier_key(self._namespace, modality, identifier)

    def stager_counts(self) -> StagerCounts | None:
        """The stager's own counts (``None`` where this side stages nothing)."""
        return None if self._stager is None else self._stager.counts()

    @property
    def claim_wait(self) -> float:
        """How long a request waits at most, from its first deferral, for items another
        claimant is encoding; 0.0 where this side claims nothing."""
        return self._claim_wait

    def claims(self) -> list[str]:
        """The key texts whose claims this side holds (their encodes and saves are due here)."""
        return [] if self._stager is None else self._stager.claims()

    def close(self) -> None:
        """Stop the stager's fetches, release its claims and drop what it staged."""
        if self._stager is not None:
            self._stager.close()

    def _key_of(self, request: Request, state: _RequestState, index: int, modality: Modality) -> EmbeddingKey:
        """The key of a request's item: the digest of its processed inputs where vLLM sent
        them, else its identifier within the request's tenant (salt, adapter); once per
        request and item, never remembered for another request."""
        key = state.keys.get(index)
        if key is not None:
            return key
        feature = request.mm_features[index]
        digest = content_digest(feature.data.get_data()) if feature.data is not None else None
        if digest is not None:
            key = EmbeddingKey(self._namespace, modality, HashScheme.BLAKE3, digest)
        else:
            lora = request.lora_request
            key = scoped_identifier_key(
                self._namespace,
                modality,
                feature.identifier,
                cache_salt=request.cache_salt,
                lora=None if lora is None else lora.lora_name,
            )
        state.keys[index] = key
        return key

    def _state_of(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            announcement = read_announcement(
                getattr(request, "ec_transfer_params", None),
                self._namespace,
                self._keyring,
                now=self._wall_clock(),
            )
            if announcement.ignored is not None:
                self._counts.add(announcements_ignored=1)
            state = _RequestState(announced=announcement.keys)
            self._requests[request.request_id] = state
        return state

    def _share(self, identifier: str, key: EmbeddingKey) -> None:
        """Note that a live request names `identifier` with `key`; two keys for one
        identifier make it conflicted (see `_conflicted`)."""
        held = self._item_keys.get(identifier)
        if held is None:
            self._item_keys[identifier] = key
        elif held != key and identifier not in self._conflicted:
            self._conflicted.add(identifier)
            self._saves.pop(identifier, None)  # it would save one image's output under the other's key
            if self._stager is not None:
                self._stager.abandon(identifier, force=True)  # neither key's save will come
                self._stager.release(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start fetching the request's items ahead of ``num_computed_tokens``; ``False`` (vLLM
        tries again next step) while any is unanswered, while an item a producer announced is
        not stored yet, or while an item another claimant is encoding has not landed. Each wait
        is bounded from the request's first deferral (the store's timeout plus 0.5 s;
        ``producer_wait_s`` for announced items; `claim_wait` for claimed ones), whatever
        answers come meanwhile; announced items are asked again at most `_MAX_RETRIES` times.
        Where the lookup thread is idle, the first look at new items waits for their answers up
        to ``first_answer_wait_s`` (a few ms) before deferring: a deferral costs vLLM an engine
        step, more than a lookup that answers at once."""
        stager = self._stager
        if stager is None:
            return True
        state = self._state_of(request)
        if state.waited_out:
            return True
        wait_s = self._settings.first_answer_wait_s
        return self._available(
            request, state, num_computed_tokens, wait_s if wait_s > 0 and stager.idle() else 0.0
        )

    def _available(
        self, request: Request, state: _RequestState, num_computed_tokens: int, wait_s: float
    ) -> bool:
        """`ensure_cache_available`'s look; `wait_s` > 0: a look that only waits for the first
        answers of new items waits for them that long, then looks once more."""
        stager = self._stager
        assert stager is not None
        now = self._clock()
        retry_due = bool(state.announced) and state.retries < _MAX_RETRIES and now >= state.next_retry
        retried = False
        waiting = False
        waiting_for_producer = False
        rechecking = False  # an item claimed elsewhere is being looked at again
        missing: list[tuple[int, str]] = []  # (index, identifier) of items answered missing
        held: list[tuple[str, str]] = []  # (key text, identifier) of items claimed elsewhere
        asked: list[str] = []  # identifiers first asked of the store by this look
        for index, feature in enumerate(request.mm_features):
            modality = modality_of(feature.modality)
            position = feature.mm_position
            if modality is None or position.offset + position.length <= num_computed_tokens:
                continue
            identifier = feature.identifier
            if identifier in self._shipped:
                continue  # in vLLM's encoder cache already (or encoded there if it was evicted)
            known = stager.state(identifier) if identifier in state.names else None
            if state.held and identifier in state.held and known is not Staged.HELD:
                if known is Staged.STAGED:
                    self._counts.add(waits_served=1)  # its claimant's entry landed, verified
                if known is not Staged.PENDING:
                    state.held.discard(identifier)
            if known is Staged.STAGED:
                continue  # answered: the common case of a later step, no key work
            if known is Staged.MISSING and not state.announced:
                missing.append((index, identifier))
                continue
            key = self._key_of(request, state, index, modality)
            first_ask = identifier not in state.names
            if first_ask:  # every live request that names it counts, conflicted or not
                self._share(identifier, key)
                state.names.add(identifier)
                self._users.setdefault(identifier, set()).add(request.request_id)
            if identifier in self._conflicted:
                continue  # encoded here
            staged = stager.want(identifier, key, request.get_num_encoder_embeds(index))
            if first_ask and staged is Staged.MISSING:  # missing for an earlier request: ask again
                stager.retry(identifier)
                staged = Staged.PENDING
            if staged is Staged.PENDING and known is None:
                asked.append(identifier)
            announced = key.to_key() in state.announced
            if staged is Staged.PENDING:
                waiting = True
                waiting_for_producer |= announced
                rechecking |= identifier in state.held
            elif staged is Staged.HELD:
                held.append((key.to_key(), identifier))
            elif staged is Staged.MISSING:
                missing.append((index, identifier))
                if announced and state.retries < _MAX_RETRIES:
                    waiting = waiting_for_producer = True
                    if retry_due:
                        stager.retry(identifier)
                        retried = True
        if retried:
            state.next_retry = now + min(_RETRY_FIRST_S * 2**state.retries, self._retry_longest)
            state.retries += 1
        waiting_for_claims = bool(held) and self._wait_in_key_order(state, held, missing, now)
        waiting_for_claims |= rechecking
        if not waiting and not waiting_for_claims:
            return True
        first_answers_only = bool(asked) and not (waiting_for_producer or waiting_for_claims or retried)
        if wait_s > 0 and first_answers_only and stager.wait_answered(asked, wait_s):
            return self._available(request, state, num_computed_tokens, 0.0)  # answered: look again
        if state.lookup_deadline is None:
            self._counts.add(deferred=1)
            state.lookup_deadline = now + self._lookup_wait
            state.producer_deadline = now + max(self._lookup_wait, self._settings.producer_wait_s)
            state.claim_deadline = now + self._claim_wait
        assert state.producer_deadline is not None and state.claim_deadline is not None
        deadline = state.lookup_deadline
        if waiting_for_producer:
            deadline = max(deadline, state.producer_deadline)
        if waiting_for_claims:
            deadline = max(deadline, state.claim_deadline)
        if now < deadline:
            return False
        self._counts.add(waited_out=1, waits_timed_out=len(state.held))
        state.held.clear()
        state.waited_out = True  # waited once: the rest is encoded here, never deferred again
        return True

    def _wait_in_key_order(
        self, state: _RequestState, held: list[tuple[str, str]], missing: list[tuple[int, str]], now: float
    ) -> bool:
        """Whether the request waits for its `held` items (claimed elsewhere), claiming in key
        order: the first held key is asked again and claimed, later ones only looked up, and a
        claim it won past the first held key is given back (it could be what the claimant of
        that key waits for). A key the request also won under another identifier is encoded
        here (it would wait for itself)."""
        stager = self._stager
        assert stager is not None
        won = [
            (state.keys[index].to_key(), identifier)
            for index, identifier in missing
            if index in state.keys and stager.won(identifier)
        ]
        mine = {text for text, _ in won}
        waited = sorted((text, identifier) for text, identifier in held if text not in mine)
        if not waited:
            return False
        first = waited[0][0]
        for text, identifier in won:
            if text > first:
                stager.give_back(identifier)
                if stager.state(identifier) is Staged.HELD:
                    waited.append((text, identifier))
        state.held.update(identifier for _, identifier in waited)
        if state.held_retries == 0 and state.next_held_retry == 0.0:
            state.next_held_retry = now + _RETRY_FIRST_S  # its claimant has only just begun
        if now >= state.next_held_retry:
            for text, identifier in waited:
                stager.retry(identifier, claim=text == first)
            pause = min(_RETRY_FIRST_S * 2**state.held_retries, _HELD_RETRY_LONGEST_S)
            state.next_held_retry = now + pause
            state.held_retries += 1
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Whether ``identifier``'s entry is staged here: fetched, verified, of the right size.

        Never calls the store: items not asked for by `ensure_cache_available` are misses.
        """
        stager = self._stager
        return (
            stager is not None
            and identifier not in self._conflicted
            and stager.state(identifier) is Staged.STAGED
        )

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Hand a staged item to this step's loads (consumers); plan the save of an item to
        encode (producers)."""
        feature = request.mm_features[index]
        identifier = feature.identifier
        if identifier in self._conflicted:
            return  # vLLM encodes it; its output is not saved under either key
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
            state = self._state_of(request)
            key = self._key_of(request, state, index, modality)
            if stager is not None and identifier not in state.names:
                self._share(identifier, key)  # (a request that was never deferred)
                state.names.add(identifier)
                self._users.setdefault(identifier, set()).add(request.request_id)
                if identifier in self._conflicted:
                    return
            self._saves[identifier] = key
            state.saved.add(key.to_key())
            if stager is not None:
                stager.saving(key.to_key())  # a claim won on it is released when the save is done

    def build_connector_meta(self) -> MMKeyECMetadata:
        """This step's loads (staged tensors, handed over) and saves."""
        if self._stager is not None and self._claim_wait:
            self._stager.expire_claims(_MAX_TRACKED)
        meta = MMKeyECMetadata(tuple(self._loads.values()), dict(self._saves))
        self._loads.clear()
        self._saves.clear()
        return meta

    def update_connector_output(self, worker_meta: object) -> None:
        """Release the claims whose saves the workers finished (written, skipped or failed),
        and those held past their hold."""
        if self._stager is None or not self._claim_wait:
            return
        if isinstance(worker_meta, MMKeyECWorkerMetadata):
            self._stager.release_claims(worker_meta.saved)
        self._stager.expire_claims(_MAX_TRACKED)

    def _forget(self, request_id: str, identifier: str) -> None:
        users = self._users.get(identifier)
        if users is None:
            return
        users.discard(request_id)
        if not users:
            del self._users[identifier]
            self._item_keys.pop(identifier, None)
            self._conflicted.discard(identifier)
            if self._stager is not None:
                self._stager.abandon(identifier)  # a claim whose save is not planned ends now
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
            return False, announce(state.saved, self._keyring)
        return False, None


def _store_timeout(cache: EmbeddingCache) -> float:
    """How long one store call may take (the cache's configured timeout), 0.5 s if unknown."""
    config = getattr(cache, "config", None)
    for name in ("timeout",):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.5
