"""Single-flight in MMKeyEmbeddingStore against a real local mooncake_master: of encoders
asked one missing image at once, one encodes it; the others wait for its entry, bounded.

Two stores here are two Mooncake clients (two encode servers of a fleet); two lookups of one
store are two requests of one server. Runs in SGLang's environment (``make test-sglang``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests._support import ROOMY_TIMEOUT, local_config, timed, wait_until
from tests.integrations.sglang.sglang_support import require_sglang, unpinned_controller

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheEntry, EntryState  # noqa: E402
from sglang.srt.multimodal.modality import Modality as SGLangModality  # noqa: E402

from mmkey import Modality  # noqa: E402
from mmkey.cache.protocol import Claim  # noqa: E402
from mmkey.integrations.sglang import MMKeyEmbeddingStore  # noqa: E402
from mmkey.integrations.sglang._claimed import WonClaims  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

pytestmark = pytest.mark.mooncake

NAMESPACE = "qwen2.5-vl-7b@rev1"
DTYPE = torch.bfloat16
LONG_WAIT = 30.0
"""The wait bound of tests where the wait must be served: far past any scheduling delay."""
SHORT_WAIT = 0.3
"""The wait bound of tests where it must run out."""
SLACK = 5.0
"""Scheduling noise on a crowded host, never a hang: a wait ends within its bound plus this."""


@pytest.fixture
def make_store(mooncake_master_session: MasterProcess) -> Iterator[Callable[..., MMKeyEmbeddingStore]]:
    made: list[MMKeyEmbeddingStore] = []

    def make(claim_wait: float = LONG_WAIT, **overrides: Any) -> MMKeyEmbeddingStore:
        cfg = local_config(mooncake_master_session, timeout=ROOMY_TIMEOUT, claim_wait=claim_wait, **overrides)
        store = MMKeyEmbeddingStore(namespace=NAMESPACE, config=cfg)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def pages(
    store: MMKeyEmbeddingStore, tokens: int, seed: int
) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """A registered vision pool whose first `tokens` rows hold an embedding, and that run."""
    pool = torch.zeros(1024, 64, dtype=DTYPE)
    pool[:tokens] = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed)).to(DTYPE)
    store.register_buffer(pool)
    return pool, [[pool.data_ptr()]], [[tokens * 64 * pool.element_size()]]


def waiting(store: MMKeyEmbeddingStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once `store` starts waiting for entries another claimant encodes."""
    entered = threading.Event()
    real = store.cache.wait_for_embeddings

    def wait(keys: Any) -> Any:
        entered.set()
        return real(keys)

    monkeypatch.setattr(store.cache, "wait_for_embeddings", wait)
    return entered


def claimable(store: MMKeyEmbeddingStore, text: str) -> bool:
    """Whether `store`'s cache can win the claim of `text` now (given back at once)."""
    key = store.key_for(text, Modality.IMAGE)
    [claim] = store.cache.claim([key])
    store.cache.release([key])
    return claim is Claim.WON


def test_of_two_encoders_one_encodes_and_the_other_is_served_when_it_puts(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = make_store(), make_store()
    src, ptrs, sizes = pages(first, 40, 801)
    dst, dst_ptrs, dst_sizes = pages(second, 40, 0)
    dst.zero_()
    entered = waiting(second, monkeypatch)
    assert first.batch_is_exist(["801"]) == [False]  # won: SGLang encodes it here
    assert "801" in first._won
    with concurrent.futures.ThreadPoolExecutor(1) as other:
        asked = other.submit(second.batch_is_exist, ["801"])
        assert entered.wait(LONG_WAIT)  # held by the first encoder: it waits
        assert not asked.done()
        assert first.batch_put_from_multi_buffers(["801"], ptrs, sizes) == [True]
        assert asked.result(timeout=LONG_WAIT + SLACK) == [True]  # present: SGLang's global hit
    assert "801" not in first._won  # the put ended the claim
    assert second.batch_get_into_multi_buffers(["801"], dst_ptrs, dst_sizes) == [True]
    assert torch.equal(dst[:40], src[:40])
    won, waited = first.stats(), second.stats()
    assert (won.claims_won, won.waits_served, won.coalesced) == (1, 0, 0)
    assert (waited.claims_won, waited.waits_served, waited.waits_timed_out, waited.coalesced) == (0, 1, 0, 1)
    assert won.inserts == 1 and waited.inserts == 0  # one encode, one write


def test_two_requests_of_one_server_coalesce_without_asking_the_master_twice(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    _, ptrs, sizes = pages(store, 16, 802)
    entered = waiting(store, monkeypatch)
    assert store.batch_is_exist(["802"]) == [False]
    with concurrent.futures.ThreadPoolExecutor(1) as other:
        asked = other.submit(store.batch_is_exist, ["802"])
        assert entered.wait(LONG_WAIT)  # held by this store's first request
        assert store.batch_put_from_multi_buffers(["802"], ptrs, sizes) == [True]
        assert asked.result(timeout=LONG_WAIT + SLACK) == [True]
    stats = store.stats()
    assert (stats.claims_won, stats.waits_served, stats.coalesced) == (1, 1, 1)


def test_a_claimant_that_never_puts_costs_a_waiter_the_bound_then_it_encodes(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    claimant, waiter = make_store(), make_store(claim_wait=SHORT_WAIT)
    assert claimant.batch_is_exist(["803"]) == [False]
    answer, took = timed(lambda: waiter.batch_is_exist(["803"]))
    assert answer == [False]  # missing after the bound: SGLang encodes it
    assert took < SHORT_WAIT + SLACK  # bounded, never a hang
    stats = waiter.stats()
    assert (stats.waits_served, stats.waits_timed_out, stats.coalesced) == (0, 1, 0)


def test_a_call_that_won_any_hash_waits_for_none(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    """Two requests that each won what the other needs never wait on each other."""
    first, second = make_store(), make_store()
    assert first.batch_is_exist(["804"]) == [False]
    answer, took = timed(lambda: second.batch_is_exist(["804", "805"]))
    assert answer == [False, False] and took < LONG_WAIT  # 805 won here: both encoded here
    stats = second.stats()
    assert (stats.claims_won, stats.waits_served, stats.waits_timed_out) == (1, 0, 0)


def test_a_put_that_stores_nothing_still_gives_the_claim_back(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    first, second = make_store(), make_store()
    assert first.batch_is_exist(["806"]) == [False]
    assert not claimable(second, "806")
    outside = torch.zeros(64, 64, dtype=DTYPE)  # memory SGLang never registered: refused
    assert first.batch_put_from_multi_buffers(["806"], [[outside.data_ptr()]], [[64 * 64 * 2]]) == [False]
    assert "806" not in first._won
    assert wait_until(lambda: claimable(second, "806"), SLACK)  # released at the master


def test_an_abandoned_claim_is_given_back_at_its_hold_by_an_injected_clock(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """The encode failed, or the request was aborted: no put comes."""
    now = [0.0]
    first, second = make_store(), make_store()
    first._won = WonClaims(first._give_back, 2.0, 100, clock=lambda: now[0], sweep=False)
    assert first.batch_is_exist(["807"]) == [False]
    now[0] += 1.9
    assert first._won.expire() == 0 and not claimable(second, "807")
    now[0] += 0.1
    assert first._won.expire() == 1
    assert wait_until(lambda: claimable(second, "807"), SLACK)


def test_an_abandoned_claim_is_given_back_by_the_stores_own_thread(
    make_store: Callable[..., MMKeyEmbeddingStore],
) -> None:
    """Real time: the hold is the wait bound, and nothing but the store ends it."""
    first, second = make_store(claim_wait=SHORT_WAIT), make_store()
    assert first.batch_is_exist(["808"]) == [False]
    assert wait_until(lambda: "808" not in first._won, SLACK)
    assert wait_until(lambda: claimable(second, "808"), SLACK)


def test_close_gives_back_the_claims_a_store_holds(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    first, second = make_store(), make_store()
    assert first.batch_is_exist(["809"]) == [False]
    first.close()
    assert len(first._won) == 0
    assert wait_until(lambda: claimable(second, "809"), LONG_WAIT)


def test_a_lookup_with_every_wait_slot_taken_answers_at_once_without_waiting(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waits are bounded in number: past them a lookup of a held hash answers no, never queues."""
    claimant, waiter = make_store(), make_store(claim_wait=SHORT_WAIT)
    entered = waiting(waiter, monkeypatch)
    assert claimant.batch_is_exist(["812"]) == [False]  # won: held by the claimant
    taken = 0
    while waiter._wait_slots.acquire(blocking=False):  # every slot busy with another wait
        taken += 1
    with concurrent.futures.ThreadPoolExecutor(1) as other:
        asked = other.submit(waiter.batch_is_exist, ["812"])
        done, _ = concurrent.futures.wait([asked], timeout=SLACK)
        for _ in range(taken):  # a lookup queued for a slot (none should be) goes on
            waiter._wait_slots.release()
    assert taken >= 1 and done and asked.result() == [False]  # encoded here, at once
    assert not entered.is_set()
    stats = waiter.stats()
    assert (stats.claims_won, stats.waits_served, stats.waits_timed_out) == (0, 0, 0)


def test_claims_off_answer_at_once_and_count_nothing(make_store: Callable[..., MMKeyEmbeddingStore]) -> None:
    first, second = make_store(claim_wait=0), make_store(claim_wait=0)
    assert first.batch_is_exist(["810"]) == [False]
    assert second.batch_is_exist(["810"]) == [False]  # no claim: both encode
    assert len(first._won) == 0
    assert first.stats().claims_won == 0 and second.stats().waits_timed_out == 0


def fill(controller: Any, mm_hash: str, tensor: torch.Tensor) -> None:
    """Put `tensor` into the controller's vision pool as a READY entry (SGLang's page
    allocation and page-run copy; stands in for `store_to_pool_async` from a CUDA tensor)."""
    pool = controller.vision_pool
    with controller.lock:
        runs = controller._allocate_with_eviction(pool, tensor.shape[0])
        entry = EmbeddingCacheEntry(
            hash=mm_hash,
            modality=SGLangModality.IMAGE,
            num_tokens=tensor.shape[0],
            dim=tensor.shape[1],
            page_runs=runs,
            state=EntryState.FILLING,
        )
        controller.entries[mm_hash] = entry
    controller._copy_embedding_page_runs(tensor, pool.tensor, entry, pool, src_is_pool=False)
    with controller.lock:
        controller._mark_ready(entry)


def test_sglangs_lookup_waits_off_its_event_loop_and_takes_the_global_hit(
    make_store: Callable[..., MMKeyEmbeddingStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through SGLang's own controllers: the encoder that lost the claim awaits SGLang's
    lookup while a coroutine on the same loop has the winner put the image; a wait that held
    the loop would keep that coroutine from running until the bound, and answer no."""
    writer_store, reader_store = make_store(), make_store()
    image = torch.randn(50, 64, generator=torch.Generator().manual_seed(811)).to(DTYPE)
    dims = {"image": 64, "audio": 32}
    with (
        unpinned_controller(writer_store, dims, DTYPE) as writer,
        unpinned_controller(reader_store, dims, DTYPE) as reader,
    ):
        entered = waiting(reader_store, monkeypatch)
        assert asyncio.run(writer.batch_is_exist(["811"])) == [False]  # won: the writer encodes

        async def both() -> list[bool]:
            lookup = asyncio.ensure_future(reader.batch_is_exist(["811"]))
            assert await asyncio.to_thread(entered.wait, LONG_WAIT)
            assert not lookup.done()
            fill(writer, "811", image)  # the writer's encode landing in its pool ...
            writer.insert_batch(["811"], SGLangModality.IMAGE)  # ... and SGLang's put
            return await lookup

        assert asyncio.run(both()) == [True]
        reader.prefetch("req", ["811"], [50], SGLangModality.IMAGE)
        assert wait_until(lambda: reader.check_prefetch_progress("req"), LONG_WAIT)
        [views] = reader.get_pool_views(["811"])
        assert views is not None and torch.equal(torch.cat(views), image)
        reader.release_pool_views(["811"])
    assert reader_store.stats().coalesced == 1 and writer_store.stats().claims_won == 1
