"""Pins of the scheduler side's waits (`SchedulerSide`) that the connector tests leave open:
the cap on retries of an announced item, ... (found by a mutation pass).

Logic tests on the in-process fake Mooncake behind the connector's `MooncakeCache`, or the
memory store, and a clock the test moves (the connector's ``_clock``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import (
    StepClock,
    connector,
    install_step_clock,
    produce,
    request,
    require_vllm,
    schedule,
    until_available,
    vllm_config,
)

require_vllm()

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

import mmkey.integrations.vllm._connector as connector_module  # noqa: E402
from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig  # noqa: E402
from mmkey.cache.protocol import Claim  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector, MMKeyECMetadata  # noqa: E402
from mmkey.integrations.vllm._connector_settings import content_digest  # noqa: E402
from mmkey.integrations.vllm._stager import Staged  # noqa: E402
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.request import Request

ROWS = 4


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    return install_step_clock(monkeypatch)


@pytest.fixture
def fake_master(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMooncakeMaster]:
    """A fake Mooncake master and a holder that lends it memory; every connector made in the
    test opens its cache on it."""
    fake_cache = functools.partial(MooncakeCache, store_class=FakeMooncakeStore)
    monkeypatch.setattr(connector_module, "MooncakeCache", fake_cache)
    with FakeMooncakeMaster() as master:
        holder = MooncakeConfig(
            master_server_address=master.address, global_segment_size=16 << 20, local_buffer_size=4 << 20
        )
        with fake_cache(holder):
            yield master


def store_fields(address: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "master_server_address": address,
        "global_segment_size": "16MB",
        "local_buffer_size": "4MB",
        "timeout": 1.0,
        "setup_timeout": 5.0,
        "retry_after": 0.2,
        "claim_wait": 0,
    }
    fields.update(overrides)
    return fields


def pixels(seed: int) -> torch.Tensor:
    return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def own_key(namespace: str, image: torch.Tensor) -> EmbeddingKey:
    """The key the connector gives an image of `pixels` (its ``pixel_values``)."""
    digest = content_digest({"pixel_values": image})
    assert digest is not None
    return EmbeddingKey(namespace, Modality.IMAGE, HashScheme.BLAKE3, digest)


def settle(sched: MMKeyECConnector, names: Sequence[str]) -> None:
    """Wait until the stager answered every item of `names` it was asked for."""
    stager = sched._scheduler._stager
    assert stager is not None
    assert wait_until(lambda: all(stager.state(n) is not Staged.PENDING for n in names), 10.0, poll=0.0005)


def count_lookups(monkeypatch: pytest.MonkeyPatch, sched: MMKeyECConnector, key: EmbeddingKey) -> list[int]:
    """How many store reads named `key` (one counter, in a list)."""
    seen = [0]
    real = sched.cache.get_embeddings

    def counting(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        seen[0] += sum(1 for k in keys if k == key)
        return real(keys)

    monkeypatch.setattr(sched.cache, "get_embeddings", counting)
    return seen


def steps_until_available(sched: MMKeyECConnector, clock: StepClock, req: Request, step_s: float) -> float:
    """Step `req` (the clock moving `step_s` a step) until it is available; the time it waited."""
    names = [f.identifier for f in req.mm_features]
    start = clock.now
    while not sched.ensure_cache_available(req, 0):
        assert clock.now - start < 120.0, "deferred without end"
        settle(sched, names)
        clock.now += step_s
    return clock.now - start


def test_an_announced_item_is_asked_again_32_times_then_encoded_before_the_wait_ends(
    clock: StepClock, fake_master: FakeMooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose timeout outlasts the retries: an announced item never stored is read once
    and asked again 32 times, then the request stops waiting for it (encoded here) though
    its wait (the store's timeout plus 0.5 s) has not ended."""
    store = store_fields(fake_master.address, timeout=30.0)
    cfg = vllm_config("ec_both", namespace="capped", mooncake=store, producer_wait_s=0)
    image = pixels(1)
    key = own_key("capped", image)
    forged = {"mmkey": {"encoded": [key.to_key()]}}
    with connector(cfg, "scheduler") as sched:
        lookups = count_lookups(monkeypatch, sched, key)
        req = request("r", [("img", "image", ROWS)], data={"img": image}, ec_transfer_params=forged)
        waited = steps_until_available(sched, clock, req, step_s=0.01)
        assert lookups[0] == 1 + 32
        assert waited < 30.0  # released by the cap on its retries, not by its wait
        assert not sched.has_cache_item("img")
        assert "waited_out" not in sched.totals()


STEP_S = 1 / 128
"""A step of the tests that time looks (a binary fraction: the clock's sums are exact)."""


def test_an_item_claimed_elsewhere_is_looked_at_again_after_20_ms_then_backing_off_to_100_ms(
    clock: StepClock, fake_master: FakeMooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its claimant has only just begun: no look at the store in the first 20 ms after the
    item is answered claimed elsewhere, then looks 20 ms apart, each pause twice the one
    before, up to 100 ms."""
    cfg = vllm_config(
        "ec_both", namespace="looks", mooncake=store_fields(fake_master.address, claim_wait=3.0)
    )
    image = pixels(2)
    squatter_config = MooncakeConfig(master_server_address=fake_master.address, local_buffer_size=4 << 20)
    with (
        MooncakeCache(squatter_config, store_class=FakeMooncakeStore) as squatter,
        connector(cfg, "scheduler") as sched,
    ):
        assert squatter.claim([own_key("looks", image)]) == [Claim.WON]  # never released
        looks: list[float] = []
        real = sched.cache.batch_is_exist

        def looking(keys: Sequence[EmbeddingKey]) -> list[bool]:
            looks.append(clock.now)
            return real(keys)

        monkeypatch.setattr(sched.cache, "batch_is_exist", looking)
        req = request("r", [("img", "image", ROWS)], data={"img": image})
        assert not sched.ensure_cache_available(req, 0)
        settle(sched, ["img"])
        stager = sched._scheduler._stager
        assert stager is not None and stager.state("img") is Staged.HELD
        seen = clock.now  # the next step sees it held
        while clock.now - seen < 1.0:
            assert not sched.ensure_cache_available(req, 0)
            settle(sched, ["img"])
            clock.now += STEP_S
        gaps = [later - earlier for earlier, later in zip([seen, *looks], looks, strict=False)]
        pauses = [0.02, 0.02, 0.04, 0.08] + [0.1] * (len(gaps) - 4)
        assert len(gaps) >= 8
        for gap, pause in zip(gaps, pauses, strict=True):
            assert pause <= gap < pause + STEP_S, (gaps, pauses)


def test_an_unanswered_lookup_waits_the_stores_timeout_not_the_producers_wait(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``producer_wait_s`` bounds the wait for announced items only: a request whose lookup
    the store does not answer is let through once the store's timeout plus 0.5 s passed."""
    cfg = vllm_config("ec_both", namespace="unanswered", store="memory", producer_wait_s=5.0)
    with connector(cfg, "scheduler") as sched:
        release = threading.Event()
        real = sched.cache.get_embeddings

        def stuck(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
            release.wait(20)
            return real(keys)

        monkeypatch.setattr(sched.cache, "get_embeddings", stuck)
        req = request("r", [("img", "image", ROWS)], data={"img": pixels(3)})
        try:
            start = clock.now
            while not sched.ensure_cache_available(req, 0):
                assert clock.now - start < 10.0, "deferred without end"
                clock.now += STEP_S
            assert 1.0 <= clock.now - start < 1.0 + STEP_S  # the memory store's 0.5 s, plus 0.5 s
            totals = sched.totals()
            assert totals["waited_out"] == 1 and totals["deferred"] == 1  # one request, deferred once
        finally:
            release.set()


def test_retries_of_an_announced_item_back_off_from_20_ms_to_a_16th_of_the_producers_wait(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An announced item answered missing is asked again at once, then 20 ms later, each pause
    twice the one before, up to a 16th of ``producer_wait_s`` (2 s of 32 s)."""
    cfg = vllm_config("ec_both", namespace="backoff", store="memory", producer_wait_s=32.0)
    image = pixels(4)
    key = own_key("backoff", image)
    with connector(cfg, "scheduler") as sched:
        reads: list[float] = []
        real = sched.cache.get_embeddings

        def reading(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
            reads.extend(clock.now for k in keys if k == key)
            return real(keys)

        monkeypatch.setattr(sched.cache, "get_embeddings", reading)
        forged = {"mmkey": {"encoded": [key.to_key()]}}
        req = request("r", [("img", "image", ROWS)], data={"img": image}, ec_transfer_params=forged)
        start = clock.now
        while clock.now - start < 12.0:
            assert not sched.ensure_cache_available(req, 0)
            settle(sched, ["img"])
            clock.now += STEP_S
        assert reads[:2] == [start, start + STEP_S]  # read, answered missing, asked again at once
        gaps = [later - earlier for earlier, later in zip(reads[1:], reads[2:], strict=False)]
        pauses = [0.02 * 2**n for n in range(7)] + [2.0] * (len(gaps) - 7)
        assert len(gaps) >= 10
        for gap, pause in zip(gaps, pauses, strict=True):
            assert pause <= gap < pause + STEP_S, (gaps, pauses)


def embedding(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_freed_item_is_released_once_no_live_request_names_it() -> None:
    """`update_state_after_free`: what was staged for an item goes when the last request that
    names it frees it; freeing an item of a request this side does not track does nothing."""
    cfg = vllm_config("ec_both", namespace="freed", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("saver", [("x", "image", ROWS)])])
        produce(worker, meta, {"x": embedding(5)})
        assert worker.flush_saves(10.0)
        first, second = (request(name, [("x", "image", ROWS)]) for name in ("first", "second"))
        until_available(sched, first)
        until_available(sched, second)
        assert sched.has_cache_item("x")
        staged = sched._scheduler.stager_counts()
        assert staged is not None and staged.staged_bytes > 0
        sched.update_state_after_free(first, 0)
        assert sched.has_cache_item("x")  # the second request still names it
        sched.update_state_after_free(request("unknown", [("x", "image", ROWS)]), 0)
        sched.update_state_after_free(first, 0)  # freed twice
        assert sched.has_cache_item("x")
        sched.update_state_after_free(second, 0)
        assert not sched.has_cache_item("x")
        after = sched._scheduler.stager_counts()
        assert after is not None and after.staged_bytes == 0


def test_a_request_that_encoded_nothing_here_announces_nothing() -> None:
    """A producer announces what it encoded for a request: one whose items were all found
    finishes with no ``ec_transfer_params`` of ours, and a consumer never announces."""
    cfg = vllm_config("ec_both", namespace="quiet", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        req = request("encoded", [("x", "image", ROWS)])
        until_available(sched, req)
        sched.update_state_after_alloc(req, 0)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata)
        assert sched.request_finished(req) == (False, {"mmkey": {"encoded": [meta.saves["x"].to_key()]}})
        produce(worker, meta, {"x": embedding(6)})
        assert worker.flush_saves(10.0)
        found = request("found", [("x", "image", ROWS)])
        until_available(sched, found)
        assert sched.has_cache_item("x")
        sched.update_state_after_alloc(found, 0)
        sched.build_connector_meta(SchedulerOutput.make_empty())
        assert sched.request_finished(found) == (False, None)
        assert sched.request_finished(found) == (False, None)  # finished twice: nothing tracked
        assert sched.request_finished(request("unseen", [("x", "image", ROWS)])) == (False, None)
    with connector(vllm_config("ec_consumer", namespace="quiet", store="memory"), "scheduler") as consumer:
        req = request("consumed", [("y", "image", ROWS)])
        until_available(consumer, req)
        consumer.update_state_after_alloc(req, 0)
        consumer.build_connector_meta(SchedulerOutput.make_empty())
        assert consumer.request_finished(req) == (False, None)


def test_a_worker_side_stages_nothing_its_scheduler_hooks_never_defer_nor_find() -> None:
    """Only the scheduler role stages: on a worker-role connector every item is a miss at
    once, with no wait, whatever the store holds."""
    cfg = vllm_config("ec_both", namespace="no-stage", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("saver", [("x", "image", ROWS)])])
        produce(worker, meta, {"x": embedding(7)})
        assert worker.flush_saves(10.0)
        req = request("r", [("x", "image", ROWS)])
        assert worker.ensure_cache_available(req, 0)
        assert not worker.has_cache_item("x")
        assert worker.totals().get("lookups", 0) == 0


def test_items_allocated_without_a_lookup_are_saved_unless_two_images_share_the_identifier() -> None:
    """An item vLLM allocates that `ensure_cache_available` never looked at (a request never
    deferred) is saved under its own key; two such live requests naming one identifier with
    different images plan no save for it, until one of them lets go."""
    cfg = vllm_config("ec_both", namespace="unasked", store="memory")
    with connector(cfg, "scheduler") as sched:
        one, two = (
            request(name, [("x", "image", ROWS)], data={"x": pixels(seed)})
            for name, seed in (("one", 8), ("two", 9))
        )
        sched.update_state_after_alloc(one, 0)
        sched.update_state_after_alloc(two, 0)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata) and meta.saves == {}
        sched.request_finished(one)
        sched.request_finished(two)
        alone = request("alone", [("x", "image", ROWS)], data={"x": pixels(8)})
        sched.update_state_after_alloc(alone, 0)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata) and meta.saves == {"x": own_key("unasked", pixels(8))}


def test_an_item_missing_for_a_live_request_is_asked_again_for_the_next(
    clock: StepClock,
) -> None:
    """An item answered missing for one live request may be stored since: the next request that
    names it asks the store again, and finds it."""
    cfg = vllm_config("ec_both", namespace="again", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        first = request("first", [("x", "image", ROWS)])
        while not sched.ensure_cache_available(first, 0):
            settle(sched, ["x"])
        assert not sched.has_cache_item("x")
        worker_meta = MMKeyECMetadata(saves={"x": sched.key("x", Modality.IMAGE)})
        produce(worker, worker_meta, {"x": embedding(10)})
        assert worker.flush_saves(10.0)
        second = request("second", [("x", "image", ROWS)])
        assert not sched.ensure_cache_available(second, 0)  # asked again: deferred
        settle(sched, ["x"])
        assert sched.ensure_cache_available(second, 0)
        assert sched.has_cache_item("x")


def test_a_look_at_an_item_claimed_elsewhere_in_flight_keeps_the_claims_wait(
    clock: StepClock, fake_master: FakeMooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a look at an item claimed elsewhere is unanswered, its request still waits up to
    `claim_wait` (3 s), not only the lookup's 1.5 s; the item counts as timed out at the end."""
    cfg = vllm_config(
        "ec_both", namespace="in-flight", mooncake=store_fields(fake_master.address, claim_wait=3.0)
    )
    image = pixels(11)
    squatter_config = MooncakeConfig(master_server_address=fake_master.address, local_buffer_size=4 << 20)
    with (
        MooncakeCache(squatter_config, store_class=FakeMooncakeStore) as squatter,
        connector(cfg, "scheduler") as sched,
    ):
        assert squatter.claim([own_key("in-flight", image)]) == [Claim.WON]  # never released
        req = request("r", [("img", "image", ROWS)], data={"img": image})
        start = clock.now
        assert not sched.ensure_cache_available(req, 0)
        settle(sched, ["img"])
        stager = sched._scheduler._stager
        assert stager is not None and stager.state("img") is Staged.HELD
        release = threading.Event()
        real = sched.cache.batch_is_exist

        def stuck(keys: Sequence[EmbeddingKey]) -> list[bool]:
            release.wait(20)
            return real(keys)

        monkeypatch.setattr(sched.cache, "batch_is_exist", stuck)
        try:
            while stager.state("img") is not Staged.PENDING:  # the next look, held up
                assert not sched.ensure_cache_available(req, 0)
                clock.now += STEP_S
            while not sched.ensure_cache_available(req, 0):
                assert stager.state("img") is Staged.PENDING
                clock.now += STEP_S
            assert 3.0 <= clock.now - start < 3.0 + STEP_S
            assert sched.totals()["waits_timed_out"] == 1
        finally:
            release.set()


def test_two_images_under_one_identifier_release_the_claim_won_for_the_first(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """A claim won for an identifier that a second live request names with another image is
    released at once, its planned save called off: neither key's save will come."""
    cfg = vllm_config(
        "ec_both", namespace="two-images", mooncake=store_fields(fake_master.address, claim_wait=3.0)
    )
    key = own_key("two-images", pixels(12))
    with connector(cfg, "scheduler") as sched:
        first = request("first", [("x", "image", ROWS)], data={"x": pixels(12)})
        assert not sched.ensure_cache_available(first, 0)
        settle(sched, ["x"])
        assert sched.ensure_cache_available(first, 0)
        sched.update_state_after_alloc(first, 0)  # its save is planned, the claim kept for it
        assert sched._scheduler.claims() == [key.to_key()]
        second = request("second", [("x", "image", ROWS)], data={"x": pixels(13)})
        sched.ensure_cache_available(second, 0)
        assert sched._scheduler.claims() == []  # the save is called off with it
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata) and meta.saves == {}
        assert wait_until(lambda: key.to_key() + "#claim" not in fake_master.reserved(), 10.0, poll=0.001)


def test_only_the_announced_items_of_a_request_wait_for_their_producer(clock: StepClock) -> None:
    """A request announcing one of its images waits for that one only: once its lookups are
    answered, an item it did not announce that is missing is encoded here without a wait."""
    cfg = vllm_config("ec_both", namespace="partly", store="memory", producer_wait_s=5.0)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        saver = request("saver", [("a", "image", ROWS)], data={"a": pixels(14)})
        meta, _ = schedule(sched, [saver])
        produce(worker, meta, {"a": embedding(14)})
        assert worker.flush_saves(10.0)
        params = {"mmkey": {"encoded": [own_key("partly", pixels(14)).to_key()]}}
        data = {"a": pixels(14), "b": pixels(15)}
        req = request("r", [("a", "image", ROWS), ("b", "image", ROWS)], data=data, ec_transfer_params=params)
        assert not sched.ensure_cache_available(req, 0)
        settle(sched, ["a", "b"])
        assert sched.ensure_cache_available(req, 0)  # the clock stood still: no wait for "b"
        assert sched.has_cache_item("a") and not sched.has_cache_item("b")


def test_a_loaded_item_is_not_asked_about_again_while_its_request_lives() -> None:
    """Once handed to vLLM's encoder cache, an item is not looked up again for a later step of
    its request."""
    cfg = vllm_config("ec_both", namespace="shipped", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("saver", [("x", "image", ROWS)])])
        produce(worker, meta, {"x": embedding(16)})
        assert worker.flush_saves(10.0)
        req = request("r", [("x", "image", ROWS)])
        until_available(sched, req)
        sched.update_state_after_alloc(req, 0)
        plan = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(plan, MMKeyECMetadata) and [i.identifier for i in plan.loads] == ["x"]
        lookups = sched.totals()["lookups"]
        assert sched.ensure_cache_available(req, 0)
        assert sched.totals()["lookups"] == lookups


def test_a_short_claim_wait_still_claims(clock: StepClock, fake_master: FakeMooncakeMaster) -> None:
    """Any ``claim_wait`` above 0 turns claims on, half a second included."""
    cfg = vllm_config(
        "ec_both", namespace="short-wait", mooncake=store_fields(fake_master.address, claim_wait=0.5)
    )
    with connector(cfg, "scheduler") as sched:
        req = request("r", [("x", "image", ROWS)], data={"x": pixels(17)})
        assert not sched.ensure_cache_available(req, 0)
        settle(sched, ["x"])
        assert sched.ensure_cache_available(req, 0)
        assert sched._scheduler.claims() == [own_key("short-wait", pixels(17)).to_key()]
