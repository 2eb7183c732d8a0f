"""The I/O-free core of a cache-aware encode, shared by the sync and async drivers.

A plan hashes the items, de-duplicates them by key, and takes the results of each cache
call in turn (`take_exists`, `take_embeddings`, `take_claims`, `take_encoded`,
`take_inserted`, `take_waited`). A cache call that raised is passed in as `FAILED`: it is
counted and logged, never re-raised.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from mmkey.cache.protocol import Claim
from mmkey.digest import HashScheme, Modality
from mmkey.encoder.items import Features, GridTHW, Items, digests_of, split_items
from mmkey.encoder.report import EncodeReport, EncodeResult
from mmkey.keys import EmbeddingKey

__all__ = ["FAILED", "Device", "EncodePlan", "Failed"]

logger = logging.getLogger("mmkey.encoder")


class Failed(enum.Enum):
    """The result of a cache call that raised."""

    FAILED = "failed"


FAILED = Failed.FAILED

Device: TypeAlias = "torch.device | str"
"""Where the embeddings of a request are returned: a `torch.device` or its text ("cuda:0")."""


def checked_device(device: object) -> torch.device | None:
    """`device` as a `torch.device` (None stays None); `TypeError`/`ValueError` naming the fix."""
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a torch.device or device text such as 'cuda:0', got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None


class EncodePlan:
    """One request on its way through the cache and the encoder."""

    def __init__(
        self,
        items: Items,
        keys: list[EmbeddingKey],
        hash_seconds: float,
        device: torch.device | None = None,
    ) -> None:
        self.items = items
        self.device = device
        self.keys = keys
        slots: dict[EmbeddingKey, int] = {}
        self.slot_of_item = [slots.setdefault(k, len(slots)) for k in keys]
        self.unique_keys = list(slots)
        self.first_item: list[int] = []
        for item, slot in enumerate(self.slot_of_item):
            if slot == len(self.first_item):
                self.first_item.append(item)
        self.found: list[torch.Tensor | None] = [None] * len(slots)
        self.fetching: list[int] = []
        self.encoding: list[int] = []
        self.encoded: list[int] = []  # every slot encoded, over both rounds
        self.won: list[int] = []  # slots claimed by this call and not yet released
        self.held: list[int] = []  # slots another claimant is encoding: waited for
        self.coalesced = 0
        self.stale = 0
        self.cache_errors = 0
        self.inserted = 0
        self.insert_failures = 0
        self.hash_seconds = hash_seconds
        self.lookup_seconds = 0.0
        self.encode_seconds = 0.0
        self.insert_seconds = 0.0
        self.wait_seconds = 0.0

    @classmethod
    def build(
        cls,
        feature: Features,
        grid_thw: GridTHW | None,
        *,
        namespace: str,
        modality: Modality,
        scheme: HashScheme,
        device: Device | None = None,
    ) -> EncodePlan:
        """Check the arguments, split and hash the items, and key them."""
        EmbeddingKey.for_digests(namespace, modality, scheme, [])  # a bad namespace fails first
        target = checked_device(device)
        start = time.perf_counter()
        items = split_items(feature, grid_thw)
        digests = digests_of(items, scheme)
        keys = EmbeddingKey.for_digests(namespace, modality, scheme, digests)
        return cls(items, keys, time.perf_counter() - start, target)

    def lookup_keys(self) -> list[EmbeddingKey]:
        """The distinct keys of the request, in first-seen order."""
        return self.unique_keys

    def cache_failed(self, operation: str, exc: BaseException) -> None:
        """Count and log a swallowed cache failure."""
        self.cache_errors += 1
        logger.warning(
            "embedding cache %s failed, encoding instead: %s: %s",
            operation,
            type(exc).__name__,
            exc,
        )

    def _checked(
        self, operation: str, result: object, length: int, kinds: type | tuple[type, ...]
    ) -> list[Any] | None:
        """`result` as a list if it is `length` values of `kinds`; else None (counted)."""
        if result is FAILED:
            return None
        if (
            isinstance(result, (list, tuple))
            and len(result) == length
            and all(isinstance(v, kinds) for v in result)
        ):
            return list(result)
        self.cache_failed(
            operation,
            TypeError(f"expected a list of {length} results, got {_describe(result)}"),
        )
        return None

    def take_exists(self, result: object) -> list[EmbeddingKey]:
        """Take ``batch_is_exist``'s answer; the keys to fetch."""
        flags = self._checked("batch_is_exist", result, len(self.unique_keys), bool)
        self.fetching = [s for s, held in enumerate(flags or []) if held]
        return [self.unique_keys[s] for s in self.fetching]

    def take_embeddings(self, result: object) -> None:
        """Take ``get_embeddings``' answer for the keys `take_exists` returned."""
        values = self._checked("get_embeddings", result, len(self.fetching), (torch.Tensor, type(None)))
        if values is None:
            return  # no answer (counted): every fetched item is encoded
        for slot, value in zip(self.fetching, values, strict=True):
            if isinstance(value, torch.Tensor):
                self.found[slot] = value
            else:
                self.stale += 1

    def collect_misses(self) -> int:
        """Settle which distinct items still need the encoder (not those waited for); how many."""
        held = set(self.held)
        self.encoding = [s for s, v in enumerate(self.found) if v is None and s not in held]
        return len(self.encoding)

    def miss_keys(self) -> list[EmbeddingKey]:
        """The keys of the items `collect_misses` settled on."""
        return [self.unique_keys[s] for s in self.encoding]

    def take_claims(self, result: object) -> None:
        """Take ``claim``'s answer for `miss_keys`: the won are encoded (and released), the
        held waited for; an unanswered claim encodes everything."""
        answers = self._checked("claim", result, len(self.encoding), Claim)
        if answers is None:
            return
        self.won = [s for s, a in zip(self.encoding, answers, strict=True) if a is Claim.WON]
        self.held = [s for s, a in zip(self.encoding, answers, strict=True) if a is Claim.HELD]
        self.collect_misses()

    def won_keys(self) -> list[EmbeddingKey]:
        """The keys this call claimed and has not released yet."""
        return [self.unique_keys[s] for s in self.won]

    def held_keys(self) -> list[EmbeddingKey]:
        """The keys another claimant is encoding."""
        return [self.unique_keys[s] for s in self.held]

    def take_waited(self, result: object) -> None:
        """Take ``wait_for_embeddings``' answer for `held_keys`; what did not land is encoded."""
        values = self._checked("wait_for_embeddings", result, len(self.held), (torch.Tensor, type(None)))
        for slot, value in zip(self.held, values or [], strict=True):
            if isinstance(value, torch.Tensor):
                self.found[slot] = value
                self.coalesced += 1
        self.held = []

    def encode_inputs(self) -> tuple[Any, torch.Tensor | None]:
        """The features and grids of the missed items, in the request's layout."""
        picked = [self.first_item[s] for s in self.encoding]
        items = self.items
        grids = self._grids(picked)
        packed = items.packed
        if packed is None:
            return [items.rows[i] for i in picked], grids
        if picked == list(range(picked[0], picked[0] + len(picked))):
            sizes = [r.shape[0] for r in items.rows]
            start = sum(sizes[: picked[0]])
            length = sum(sizes[picked[0] : picked[-1] + 1])
            if length == packed.shape[0]:
                return packed, grids
            return packed.narrow(0, start, length), grids
        return torch.cat([items.rows[i] for i in picked]), grids

    def _grids(self, picked: list[int]) -> torch.Tensor | None:
        given = self.items.grid_tensor
        if given is not None:
            return given if len(picked) == given.shape[0] else given[picked]
        if self.items.grids is None:
            return None
        return torch.tensor([self.items.grids[i] for i in picked], dtype=torch.long)

    def take_encoded(self, output: object) -> tuple[list[EmbeddingKey], list[torch.Tensor]]:
        """Check the encoder's output; the keys and embeddings to insert."""
        embeddings = _check_encoder_output(output, len(self.encoding))
        for slot, embedding in zip(self.encoding, embeddings, strict=True):
            self.found[slot] = embedding
        self.encoded.extend(self.encoding)
        return [self.unique_keys[s] for s in self.encoding], embeddings

    def take_inserted(self, result: object) -> None:
        """Take ``insert_batch``'s answer for the keys `take_encoded` returned."""
        n = len(self.encoding)
        flags = self._checked("insert_batch", result, n, bool)
        held = sum(flags) if flags is not None else 0
        self.inserted += held
        self.insert_failures += n - held

    def _target_device(self) -> torch.device | None:
        """The requested device; else the encoder's (first output); else the features'."""
        if self.device is not None:
            return self.device
        for slot in self.encoded:
            encoded = self.found[slot]
            if encoded is not None:
                return encoded.device
        rows = self.items.rows
        return rows[0].device if rows else None

    def result(self) -> EncodeResult:
        """The embeddings in input order, all on one device, and the report of this call."""
        target = self._target_device()
        if target is not None:
            self.found = [t if t is None or t.device == target else t.to(target) for t in self.found]
        embeddings = [self.found[s] for s in self.slot_of_item]
        assert all(e is not None for e in embeddings), "every item is found or encoded"
        report = EncodeReport(
            items=len(self.items),
            unique=len(self.unique_keys),
            hits=len(self.unique_keys) - len(self.encoded) - self.coalesced,
            encoded=len(self.encoded),
            coalesced=self.coalesced,
            stale=self.stale,
            cache_errors=self.cache_errors,
            inserted=self.inserted,
            insert_failures=self.insert_failures,
            hashed_bytes=self.items.nbytes,
            hash_seconds=self.hash_seconds,
            lookup_seconds=self.lookup_seconds,
            encode_seconds=self.encode_seconds,
            insert_seconds=self.insert_seconds,
            wait_seconds=self.wait_seconds,
        )
        return EncodeResult([e for e in embeddings if e is not None], self.keys, report)


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in itertools.islice(value, 100)})
        return f"{type(value).__name__} of {len(value)} ({', '.join(kinds) or 'empty'})"
    return type(value).__name__


def _check_encoder_output(output: object, expected: int) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        raise TypeError(
            f"encode returned one tensor of shape {list(output.shape)}; it must return one "
            f"embedding per missed item ({expected}), e.g. list(out.split(tokens_per_item))"
        )
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence):
        raise TypeError(f"encode must return a sequence of {expected} tensors, got {type(output).__name__}")
    embeddings = list(output)
    if len(embeddings) != expected:
        raise ValueError(
            f"encode returned {len(embeddings)} embeddings for {expected} missed items; "
            "it must return exactly one per item it is given, in order"
        )
    for i, embedding in enumerate(embeddings):
        if not isinstance(embedding, torch.Tensor):
            raise TypeError(
                f"encode returned {type(embedding).__name__} for missed item {i}, not a torch.Tensor"
            )
    return embeddings
