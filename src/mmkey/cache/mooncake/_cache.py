"""`MooncakeCache`: the `EmbeddingCache` protocol over a Mooncake distributed store.

The facade: key checks, the entry codec, de-duplication and counters. It closes the
binding's traps: it never calls a store that is not set up or is closed (the binding
crashes the interpreter there), de-duplicates batch reads (duplicates read wrong data),
writes with upsert (a put never overwrites), tells misses from entries (both read as
``b""``), and has every entry verified through the codec. A read goes from here to
`mmkey.cache.mooncake._reads` (which transfers, each entry checked by `mmkey.entry.codec`
in staging); writes go to `mmkey.cache.mooncake._writes`; single-flight claims to
`mmkey.cache.mooncake._claims`. Under them the transport (`mmkey.cache.mooncake._transport`)
runs every binding call on a lane within the call's give-up time (read from the cache's
clock), behind a breaker, and calls the binding's GIL-holding ``setup``/``close`` only right
after the master answered; staging (`mmkey.cache.mooncake._staging`) moves entries through
registered buffers (``batch_upsert_from``, ``batch_get_into``), not Python bytes copies.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmkey._deadline import MONOTONIC, Clock, Done
from mmkey._log import Counters
from mmkey.cache._guard import insert_args, key_texts
from mmkey.cache.health import CacheHealth
from mmkey.cache.mooncake import Added
from mmkey.cache.mooncake._claims import Claims
from mmkey.cache.mooncake._reads import Reader
from mmkey.cache.mooncake._transport import LOG, RPC_FAILURES, CacheParts, StoreTransport
from mmkey.cache.mooncake._writes import Writer
from mmkey.cache.mooncake.config import MooncakeConfig
from mmkey.cache.protocol import CacheStats, Claim
from mmkey.entry.auth import FROM_ENV, EntryKeyring, FromEnv, keyring_for_cache
from mmkey.entry.codec import encode_entry, payload_runs
from mmkey.errors import StoreClosed, StoreError
from mmkey.keys import CacheKey

if TYPE_CHECKING:
    import torch
    from mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeCache", "MooncakeConfig"]

_INSTALL_HINT = (
    "install the binding: pip install 'mmkey[mooncake-cpu]' on CPU machines (plus Debian's "
    "libibverbs1 libnuma1 libcurl4) or 'mmkey[mooncake]' on GPU machines"
)


def _target_runs(values: object, count: int, function: str, what: str) -> list[list[torch.Tensor]]:
    """One list of payload runs per key (see `read_into`), checked before anything moves;
    errors name `function` and `what`."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{function}() takes a list of {what} (one per key), got {type(values).__name__}")
    if len(values) != count:
        raise ValueError(f"{function}() got {count} keys and {len(values)} {what}")
    return [payload_runs(value, function, what) for value in values]


class MooncakeCache:
    """A strict, fault-tolerant `EmbeddingCache` over ``mooncake.store``.

    Store failures never raise into the caller: reads become misses, inserts report
    ``False``, and both are counted in ``stats().errors``. Every call returns within
    ``config.timeout`` (one timeout per call, however many transfers it takes). Only
    misuse raises: wrong key types (`TypeError`), mismatched lengths (`ValueError`), calls
    after `close` (`StoreClosed`), and a binding that cannot be imported (`StoreError`, at
    construction).

    Where entries live: in the memory segment of the process that wrote them (this cache
    lends ``config.global_segment_size`` bytes to the store). When that process closes its
    cache or exits, its entries are gone for every reader. To keep entries across restarts
    of the serving processes, run them as pure clients (``global_segment_size=0``) beside
    dedicated holder processes that lend the memory, and write ``replica_num`` > 1 copies
    so that one holder's death loses nothing.

    ``store_class`` and ``clock`` are for tests: a stand-in for the binding's
    ``MooncakeDistributedStore`` (`mmkey.testing.fake_mooncake.FakeMooncakeStore`; by default
    the binding's own), and the clock every timeout, stuck lane, breaker and quarantine period
    is measured by (a `mmkey._deadline.Clock`; by default the wall's monotonic clock).
    """

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        keyring: EntryKeyring | FromEnv | None = FROM_ENV,
        store_class: type[MooncakeDistributedStore] | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        value: object = config
        if not isinstance(value, MooncakeConfig):
            raise TypeError(
                f"MooncakeCache takes a MooncakeConfig, got {type(value).__name__}; "
                "use MooncakeConfig(master_server_address='host:port') or MooncakeConfig.from_env()"
            )
        try:
            if store_class is None:
                from mooncake.store import MooncakeDistributedStore

                store_class = MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(f"the Mooncake binding cannot be imported ({exc}); {_INSTALL_HINT}") from None
        self._config = config
        self._keyring = keyring_for_cache(keyring, "MooncakeCache", shared=True)
        self._counts = Counters()
        self._closed = False
        self._clock = clock
        on_error = functools.partial(self._counts.add, errors=1)
        self._transport = StoreTransport(config, store_class, on_error, self._skipped_by_breaker, clock)
        self._parts = CacheParts(self._transport, config, self._keyring, self._counts)
        self._reader = Reader(self._parts)
        self._writer = Writer(self._parts)
        self._claims = Claims(self._parts)
        self._told_untrusted = False
        give_up = clock() + config.setup_timeout
        self._warm_codec()
        self._transport.connect(give_up)

    def _warm_codec(self) -> None:
        """Load what the first entry written needs (the codec's runtime, the MAC's hash) now,
        at construction, rather than on the first call: on a busy host an import waits on disk."""
        import torch

        encode_entry("mmk1@warm-up@image@blake3@" + "0" * 32, torch.zeros(1), keyring=self._keyring)

    @property
    def config(self) -> MooncakeConfig:
        """The configuration this cache was made with."""
        return self._config

    @property
    def keyring(self) -> EntryKeyring | None:
        """The secrets entries are signed and verified with; None when they are not."""
        return self._keyring

    def is_connected(self) -> bool:
        """Whether the store is set up and the last call to the master succeeded."""
        return self._transport.is_connected()

    def health(self) -> CacheHealth:
        """The breaker, the quarantined holders, the lanes stuck past the timeout, and
        whether writes are held off."""
        return CacheHealth(
            breaker_open=self._transport.breaker.is_open(),
            quarantined=self._transport.quarantine.endpoints(),
            busy_lanes=self._transport.busy_lanes(),
            writes_held=self._transport.write_breaker.is_open(),
        )

    # -- the EmbeddingCache protocol ------------------------------------------------------

    def batch_is_exist(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is held by the store; `False` when the store is unreachable."""
        return self._exist_texts(self._texts(keys, "batch_is_exist"))

    def _exist_texts(self, texts: list[str]) -> list[bool]:
        """`batch_is_exist` of key texts that came from `CacheKey.to_key` (for callers that
        remember their keys' texts, as the SGLang store does)."""
        self._check_open()
        if not texts:
            return []
        outcome = self._transport.meta(lambda store: store.batch_is_exist(texts), self._give_up())
        if not isinstance(outcome, Done):
            return [False] * len(texts)
        codes = outcome.value
        if not RPC_FAILURES.isdisjoint(codes):
            self._transport.fail()
        return [code == 1 for code in codes]

    def get_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """The verified embedding of each key, or None (a miss, a corrupt entry, a fault).

        Each tensor holds exactly the bytes that verified, copied out of the registered
        staging buffer as they were hashed. Entries larger than ``config.max_entry_size``
        are misses, never fetched. A key given twice gets two distinct tensors.
        """
        texts = self._texts(keys, "get_embeddings")
        unique = list(dict.fromkeys(texts))
        found = self._reader.get(unique, self._give_up()) if unique else {}
        result: list[torch.Tensor | None] = []
        handed: set[str] = set()
        for text in texts:
            tensor = found.get(text)
            if tensor is not None:
                if text in handed:
                    tensor = tensor.clone()
                handed.add(text)
            result.append(tensor)
        hits = sum(t is not None for t in result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def insert_batch(self, keys: Sequence[CacheKey], embeddings: Sequence[torch.Tensor]) -> list[bool]:
        """Store each embedding under its key, replacing what was there; whether each is stored.

        A key given twice in one batch stores its last embedding.
        """
        give_up = self._give_up()  # the timeout counts from the call, checks included
        self._check_open()
        texts, tensors = insert_args(keys, embeddings)
        latest = dict(zip(texts, tensors, strict=True))
        written = self._writer.write(list(latest), list(latest.values()), give_up) if latest else {}
        stored = [written.get(text) is Added.STORED for text in texts]
        self._counts.add(inserts=sum(outcome is Added.STORED for outcome in written.values()))
        return stored

    def register_memory(self, tensor: torch.Tensor) -> None:
        """Register a contiguous host tensor (e.g. an embedding pool) with the store, so that
        `insert_from` sends entries straight from it, when ``config.trusted_network`` is
        set; otherwise do nothing, and `insert_from` sends entries through staging.

        Memory registered with Mooncake is writable by anyone who reaches this process's
        transfer ports (no authentication exists there), so caller memory is registered
        only on a network where every host is trusted. Registered again whenever the store
        is set up; the tensor is kept referenced until `close`. Raises `TypeError` for a
        tensor that is not contiguous CPU memory, `ValueError` for memory that overlaps
        memory registered before."""
        import torch

        self._check_open()
        value: object = tensor
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"register_memory() takes a torch.Tensor, got {type(value).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            raise TypeError(
                "register_memory() takes a non-empty contiguous CPU tensor, got shape "
                f"{tuple(tensor.shape)} on {tensor.device}"
            )
        if not self._config.trusted_network:
            if not self._told_untrusted:
                self._told_untrusted = True
                LOG.info(
                    "register_memory: not registered (trusted_network is off: registered "
                    "memory is writable from the network); puts go through staging"
                )
            return
        self._transport.register_memory(tensor)

    def read_into(
        self,
        keys: Sequence[CacheKey],
        targets: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> list[bool]:
        """Read each key's verified embedding into its target; whether each landed.

        A target is a tensor of the entry's dtype and shape, or a list of tensors (e.g.
        pages of a pool) whose concatenation along the first dimension is; contiguous CPU
        memory, written only with an entry that verified (a miss, a corrupt or forged entry,
        one of another dtype or shape, or a fault leaves it as it was). Entries move through
        this cache's own staging buffers, never straight into the targets: a transfer the
        timeout gave up on can still land much later (Mooncake cannot cancel one), and it
        must not land in memory the caller has since reused.
        """
        texts = self._texts(keys, "read_into")
        plans = _target_runs(targets, len(texts), "read_into", "targets")
        result = self._reader.read_into(texts, plans, self._give_up()) if texts else []
        hits = sum(result)
        self._counts.add(hits=hits, misses=len(result) - hits)
        return result

    def insert_from(
        self,
        keys: Sequence[CacheKey],
        payloads: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> list[bool]:
        """Store each payload under its key, replacing what was there; whether each is stored.

        A payload is one tensor, or a list of tensors (e.g. pages of a pool) that make the
        embedding when concatenated along the first dimension; contiguous CPU memory. When
        every tensor of a payload lies in memory given to `register_memory` and its key is
        not in the store yet, the entry goes to the store straight from that memory (its
        header from this cache's staging buffer, in one multi-buffer put); otherwise it is
        joined into the staging buffer first. The payload must not change until this
        returns; if it does, the stored entry fails its checksum (a miss, never a wrong
        embedding). A key given twice in one batch stores its last payload.
        """
        self._check_open()
        texts = key_texts(keys, "insert_from")
        plans = _target_runs(payloads, len(texts), "insert_from", "payloads")
        latest = dict(zip(texts, plans, strict=True))
        stored = self._writer.write_from(latest, self._give_up()) if latest else {}
        self._counts.add(inserts=sum(stored.values()))
        return [stored.get(text, False) for text in texts]

    def add_from(
        self,
        keys: Sequence[CacheKey],
        payloads: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    ) -> list[Added]:
        """Store each payload under its key only if no client of the store holds the key or
        is writing it: of clients racing to add one key, exactly one writes; what each did.

        `Added.STORED`: this call wrote the entry. `Added.HELD`: nothing written, as the
        store holds the key (whether its entry verifies or not: replace one with
        `insert_from`) or this client is writing it on another lane. A key another client's
        put session reserves while the store does not hold it is a write in progress: looked
        at again until one second has passed since this cache first saw it so (at most half
        the call's time), `Added.HELD` if it lands, else upserted over (a squat: counted in
        ``stats().squatted``, logged at WARNING, rate-limited), or `Added.RESERVED` if the
        call ends first (a later add finishes the wait). `Added.FAILED`: not written as far as this
        call knows (a fault, a full store, the timeout; a write handed to the store before the
        timeout may still complete after it, and is not counted in ``inserts``). Payloads
        are as `insert_from` takes them, sent straight from memory given to
        `register_memory` or through staging the same way; both go through Mooncake's put
        sessions, which grant a key to its first writer. A key given twice in one batch is
        added with its last payload.
        """
        self._check_open()
        texts = key_texts(keys, "add_from")
        plans = _target_runs(payloads, len(texts), "add_from", "payloads")
        latest = dict(zip(texts, plans, strict=True))
        added = self._writer.add_from(latest, self._give_up()) if latest else {}
        self._counts.add(inserts=sum(outcome is Added.STORED for outcome in added.values()))
        return [added.get(text, Added.FAILED) for text in texts]

    # -- single-flight claims (the ClaimingCache protocol) ------------------------------------

    @property
    def claim_wait(self) -> float:
        """``config.claim_wait``: how long `wait_for_embeddings` waits at most (0.0: claims off)."""
        return self._config.claim_wait

    def claim(self, keys: Sequence[CacheKey]) -> list[Claim]:
        """Claim each missed key before encoding it, so that of clients missing it at once one
        encodes (a put session on a lease key per key); what each claim answered.

        `Claim.WON`: encode it, insert it, then `release` it (also when the encode fails).
        `Claim.HELD`: another client, or another caller of this cache, is encoding it, or its
        entry landed since the caller looked: `wait_for_embeddings`. `Claim.UNCLAIMED`: claims
        are off (``claim_wait`` 0), the store did not answer within the timeout, or this
        cache's writes are held off (``health().writes_held``: its entry would not land, so
        no other client waits for it): encode it.
        """
        texts = self._texts(keys, "claim")
        if not texts or self._config.claim_wait == 0 or self._transport.write_breaker.is_open():
            return [Claim.UNCLAIMED] * len(texts)
        answers = self._claims.claim(texts, self._give_up())
        return [answers[text] for text in texts]

    def release(self, keys: Sequence[CacheKey]) -> None:
        """Give up this cache's claims on ``keys`` (keys it did not win are ignored); returns at
        once, the store is told in the background."""
        self._claims.release(self._texts(keys, "release"))

    def wait_for_embeddings(self, keys: Sequence[CacheKey]) -> list[torch.Tensor | None]:
        """Wait at most ``claim_wait`` seconds for the entries of keys claimed elsewhere, then
        read those that landed (the normal verified read); each embedding, or None (encode it).

        Counted: ``waits_served`` (landed), ``waits_timed_out`` (not landed: within the bound,
        before its claim was given up unwritten, or before the store stopped answering),
        ``coalesced`` (read and verified: an encode saved).
        """
        texts = self._texts(keys, "wait_for_embeddings")
        wait = self._config.claim_wait
        if not texts or wait == 0:
            return [None] * len(texts)
        landed = self._claims.wait(texts, wait)
        unique = set(texts)
        wanted = [key for key, text in zip(keys, texts, strict=True) if text in landed]
        read = dict(zip((k.to_key() for k in wanted), self.get_embeddings(wanted), strict=True))
        self._counts.add(
            waits_served=len(landed),
            waits_timed_out=len(unique) - len(landed),
            coalesced=sum(read.get(text) is not None for text in unique),
        )
        return [read.get(text) for text in texts]

    def prefetch(self, keys: Sequence[CacheKey]) -> int:
        """How many of the keys the store holds (a remote store has no nearer tier)."""
        return sum(self.batch_is_exist(keys))

    def stats(self) -> CacheStats:
        """Hits, misses, inserts, corrupt and forged entries, store errors and calls answered
        without the store since creation. `entries` and `bytes_held` are ``None``: the entries
        live in the store's holders, and this client cannot know how many of them are held."""
        self._check_open()
        # the entries live in the store's holders, not here
        return CacheStats(**self._counts.totals(), bytes_held=None, entries=None)

    def close(self) -> None:
        """Close the store; later calls raise `StoreClosed`, calls in flight return at once.

        Waits at most ``config.timeout`` for the worker. Mooncake's own close holds the GIL
        (every thread of the process stops for it: about 1 s for a pure client, 2 s with a
        segment, measured), so it runs only right after the master answered a request; a
        store whose master does not answer is left open, unreachable, until the process
        exits, rather than freezing the process for tens of seconds.
        """
        if self._closed:
            return
        self._closed = True
        self._transport.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"{self!r} was never closed: its store, worker thread and registered buffer "
                "live until the process exits; call close() or use it as a context manager",
                ResourceWarning,
                stacklevel=2,
            )

    def __enter__(self) -> MooncakeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.is_connected() else "degraded")
        auth = "" if self._keyring is None else f", key_id={self._keyring.current.key_id.hex()}"
        return f"MooncakeCache({self._config.master_server_address!r}, {state}{auth})"

    # -- the call's time, and calls the breaker answered -----------------------------------

    def _give_up(self) -> float:
        return self._clock() + self._config.timeout

    def _skipped_by_breaker(self) -> None:
        self._parts.skipped("master unreachable (breaker open)")

    # -- checks ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this MooncakeCache is closed; create a new one")

    def _texts(self, keys: Sequence[CacheKey], method: str) -> list[str]:
        self._check_open()
        return key_texts(keys, method)
