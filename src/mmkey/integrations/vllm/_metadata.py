"""What travels from the scheduler side to the workers each step (`MMKeyECMetadata` of
`LoadItem`), what travels back (`MMKeyECWorkerMetadata`: the saves done), and the connector's
counters as vLLM aggregates and logs them (`MMKeyECStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import attrs
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from mmkey.keys import EmbeddingKey

__all__ = ["LoadItem", "MMKeyECMetadata", "MMKeyECStats", "MMKeyECWorkerMetadata"]


@attrs.frozen(slots=True)
class LoadItem:
    """One encoder output a worker puts into its encoder cache this step.

    The scheduler side fetched and verified it (right key, checksum, number of rows) before it
    said the item was cached: the worker only moves it to its device.
    """

    identifier: str
    tensor: torch.Tensor = attrs.field(eq=False, repr=lambda t: f"<{tuple(t.shape)} {t.dtype}>")


@attrs.frozen(slots=True)
class MMKeyECMetadata(ECConnectorMetadata):
    """The scheduler's plan for one step: what to load, and the key of each output to save."""

    loads: tuple[LoadItem, ...] = ()
    saves: dict[str, EmbeddingKey] = attrs.field(factory=dict)


@attrs.frozen(slots=True)
class MMKeyECWorkerMetadata(ECConnectorWorkerMetadata):
    """What a saving worker tells the scheduler side after a step: the key texts whose saves
    finished (written, skipped as stored, failed or dropped), so that their claims end."""

    saved: frozenset[str] = frozenset()

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """These saves and those of ``other`` (another worker's)."""
        if not isinstance(other, MMKeyECWorkerMetadata):
            return self
        return MMKeyECWorkerMetadata(self.saved | other.saved)


_STAT_NAMES = (
    "lookups",
    "found",
    "wrong_size",
    "over_budget",
    "deferred",
    "waited_out",
    "loaded",
    "saves",
    "saved",
    "saves_skipped",
    "save_failures",
    "saves_dropped",
    "store_errors",
    "announcements_ignored",
    "claims_won",
    "claims_held",
    "waits_served",
    "waits_timed_out",
)


@dataclass
class MMKeyECStats(ECConnectorStats):
    """Counters of an interval, summed over workers and the scheduler (vLLM logs them).

    Scheduler side: ``lookups``/``found`` (items asked of the store, found verified and of the
    right size), ``wrong_size``, ``over_budget`` (found but not staged), ``deferred`` (times a
    request waited for its fetches), ``waited_out`` (times the wait ended with items still
    unanswered: they are encoded). Worker side: ``loaded``; ``saves``/``saved``/
    ``saves_skipped`` (already stored)/``save_failures``/``saves_dropped`` (over the pending
    budget). ``store_errors``: store calls that raised. ``announcements_ignored``: requests
    whose ``ec_transfer_params`` named keys of another namespace, were malformed, or were
    not signed with the fleet's entry secret where one is set. Single-flight (producers over a
    cache with claims on): ``claims_won`` (missing items this instance claimed and encodes),
    ``claims_held`` (answers that another claimant encodes an item), ``waits_served`` (items a
    request waited for that landed and were staged: encodes saved), ``waits_timed_out`` (items
    still not landed when the request's wait ended: encoded here).
    """

    def reset(self) -> None:
        """Zero every counter."""
        self.data.clear()

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        """Sum the counters of ``other`` into these."""
        for name, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, plus ``hit_rate`` (found over lookups) when there were lookups."""
        out: dict[str, int | float] = {
            n: v for n, v in self.data.items() if isinstance(v, (int, float)) and v
        }
        lookups = self.data.get("lookups", 0)
        if lookups:
            out["hit_rate"] = round(self.data.get("found", 0) / lookups, 4)
        return out

    def is_empty(self) -> bool:
        """Whether no counter moved."""
        return not any(self.data.get(n) for n in _STAT_NAMES)
