"""Single-flight in `MMKeyECConnector`: of instances sharing a store that miss one item at once,
one claims and encodes it, the others wait for its entry, bounded, and load it.

Logic tests run on the in-process fake Mooncake (`FakeMooncakeStore` behind the connector's
`MooncakeCache`) and a clock the test moves (the connector's ``_clock``); one runs against a
real master. The stager answers from its own thread, so each step waits until it has filed them.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import (
    StepClock,
    connector,
    install_step_clock,
    mooncake_extra,
    request,
    require_vllm,
    vllm_config,
)

require_vllm()

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ECConnectorOutput  # noqa: E402

import mmkey.integrations.vllm._connector as connector_module  # noqa: E402
from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig  # noqa: E402
from mmkey.cache.protocol import Claim  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector, MMKeyECMetadata  # noqa: E402
from mmkey.integrations.vllm._connector_settings import content_digest  # noqa: E402
from mmkey.integrations.vllm._metadata import MMKeyECWorkerMetadata  # noqa: E402
from mmkey.integrations.vllm._stager import Staged, Stager  # noqa: E402
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import ECRole, VllmConfig
    from vllm.v1.request import Request

HIDDEN = 32
ROWS = 4
STEP_S = 0.01
"""The time one engine step takes on the test's clock."""
TIMEOUT_S = 1.0
"""The store's timeout: a request's lookups wait 1.5 s at most."""
CLAIM_WAIT_S = 3.0
"""The cache's ``claim_wait``: a request waits this long at most for an item claimed elsewhere."""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    return install_step_clock(monkeypatch)


@pytest.fixture
def fake_master(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMooncakeMaster]:
    """A fake Mooncake master and a holder that lends it memory (the scheduler sides lend
    none); every connector made in the test opens its cache on it."""
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
        "timeout": TIMEOUT_S,
        "setup_timeout": 5.0,
        "retry_after": 0.2,
        "claim_wait": CLAIM_WAIT_S,
    }
    fields.update(overrides)
    return fields


def config(address: str, role: ECRole = "ec_both", **overrides: Any) -> VllmConfig:
    return vllm_config(role, namespace="single-flight", mooncake=store_fields(address, **overrides))


def pixels(seed: int) -> torch.Tensor:
    return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def embedding(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def key_of(image: torch.Tensor) -> EmbeddingKey:
    digest = content_digest({"pixel_values": image})
    assert digest is not None
    return EmbeddingKey("single-flight", Modality.IMAGE, HashScheme.BLAKE3, digest)


def image_request(request_id: str, seeds: Sequence[int]) -> Request:
    """A request of one image per seed, identified by its seed (``img-<seed>``)."""
    return request(
        request_id,
        [(f"img-{seed}", "image", ROWS) for seed in seeds],
        data={f"img-{seed}": pixels(seed) for seed in seeds},
    )


def settle(sched: MMKeyECConnector, req: Request) -> None:
    """Wait until the stager answered every item of `req` it was asked for."""
    stager = sched._scheduler._stager
    assert stager is not None
    names = [f.identifier for f in req.mm_features]
    assert wait_until(lambda: all(stager.state(n) is not Staged.PENDING for n in names), 10.0, poll=0.0005)


def step(sched: MMKeyECConnector, req: Request) -> bool:
    """One engine step of `req`: `ensure_cache_available`, then the stager's answers filed."""
    available = sched.ensure_cache_available(req, 0)
    settle(sched, req)
    return available


def steps_until_available(
    sched: MMKeyECConnector, clock: StepClock, req: Request, *, limit_s: float
) -> float:
    """Step `req` (the clock moving `STEP_S` a step) until it is available; the time it waited."""
    start = clock.now
    while not step(sched, req):
        assert clock.now - start < limit_s, "deferred past its bound"
        clock.now += STEP_S
    return clock.now - start


def claim_first(sched: MMKeyECConnector, req: Request) -> None:
    """`req` finds its items missing and claims them: available at once, to be encoded here."""
    assert not step(sched, req)  # asked the store
    assert step(sched, req)
    for feature in req.mm_features:
        assert not sched.has_cache_item(feature.identifier)


def encode_and_save(
    sched: MMKeyECConnector, worker: MMKeyECConnector, req: Request, outputs: dict[str, torch.Tensor]
) -> None:
    """`req` is scheduled, encoded (`outputs`) and saved, and the worker's report of its saves
    reaches the scheduler side, as vLLM carries it (`ECConnectorOutput`)."""
    for index in range(len(req.mm_features)):
        sched.update_state_after_alloc(req, index)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, MMKeyECMetadata)
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    encoder_cache: dict[str, torch.Tensor] = {}
    for identifier, tensor in outputs.items():
        encoder_cache[identifier] = tensor
        worker.save_caches(encoder_cache=encoder_cache, mm_hash=identifier)
    assert worker.flush_saves(10.0)
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    sched.request_finished(req)
    sched.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=pickle.loads(pickle.dumps(report)))
    )


def another_client(master: FakeMooncakeMaster) -> MooncakeCache:
    """A raw client of `master` beside the connectors: another claimant, or a writer that does
    not claim."""
    config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 << 20)
    return MooncakeCache(config, store_class=FakeMooncakeStore)


def lease_gone(master: FakeMooncakeMaster, key: EmbeddingKey) -> bool:
    return wait_until(lambda: key.to_key() + "#claim" not in master.reserved(), 10.0, poll=0.001)


def test_a_held_item_defers_its_request_until_the_claimants_entry_lands_and_loads_it(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    cfg = config(fake_master.address)
    key = key_of(pixels(1))
    with (
        connector(cfg, "scheduler") as a,
        connector(cfg, "worker") as a_worker,
        connector(cfg, "scheduler") as b,
    ):
        a_req, b_req = image_request("a", [1]), image_request("b", [1])
        claim_first(a, a_req)
        assert a._scheduler.claims() == [key.to_key()]
        for _ in range(20):  # B waits while A encodes, asking again now and then
            assert not step(b, b_req)
            clock.now += STEP_S
        assert not b.has_cache_item("img-1")
        encode_and_save(a, a_worker, a_req, {"img-1": embedding(1)})
        assert a._scheduler.claims() == []  # released once the save was written
        assert lease_gone(fake_master, key)
        waited = steps_until_available(b, clock, b_req, limit_s=CLAIM_WAIT_S)
        assert waited < CLAIM_WAIT_S  # served when the entry landed, not at the bound
        assert b.has_cache_item("img-1")
        b.update_state_after_alloc(b_req, 0)
        meta = b.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata) and meta.saves == {}
        assert [item.identifier for item in meta.loads] == ["img-1"]
        assert torch.equal(meta.loads[0].tensor, embedding(1))  # A's output, verified
        assert a.totals()["claims_won"] == 1 and "claims_won" not in b.totals()
        b_totals = b.totals()
        assert b_totals["claims_held"] >= 1 and b_totals["waits_served"] == 1
        assert "waits_timed_out" not in b_totals and "waited_out" not in b_totals


def test_past_the_bound_a_held_item_is_encoded_here_and_counted_timed_out(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """A squatter (a raw client that holds the item's lease and never writes or lets go)
    costs a request the bound, ``max(store timeout + 0.5 s, claim_wait)`` from its first
    deferral, with a bounded number of looks at the store; then it is encoded here."""
    cfg = config(fake_master.address)
    key = key_of(pixels(2))
    with another_client(fake_master) as squatter:
        assert squatter.claim([key]) == [Claim.WON]  # never released
        with connector(cfg, "scheduler") as b:
            b_req = image_request("b", [2])
            starts = fake_master.calls["batch_put_session_start"]
            waited = steps_until_available(b, clock, b_req, limit_s=CLAIM_WAIT_S + 1.0)
            assert CLAIM_WAIT_S - STEP_S <= waited <= CLAIM_WAIT_S + 2 * STEP_S
            assert fake_master.calls["batch_put_session_start"] - starts <= 40  # backed off
            assert not b.has_cache_item("img-2")
            assert b.ensure_cache_available(b_req, 0)  # never deferred again
            b.update_state_after_alloc(b_req, 0)
            meta = b.build_connector_meta(SchedulerOutput.make_empty())
            assert isinstance(meta, MMKeyECMetadata) and meta.saves == {
                "img-2": key
            }  # encoded and saved here
            totals = b.totals()
            assert totals["waits_timed_out"] == 1 and totals["waited_out"] == 1
            assert "waits_served" not in totals and "claims_won" not in totals


def test_a_claimant_that_lets_go_without_a_save_releases_at_once_and_a_waiter_takes_over(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    cfg = config(fake_master.address)
    key = key_of(pixels(3))
    with connector(cfg, "scheduler") as a, connector(cfg, "scheduler") as b:
        a_req, b_req = image_request("a", [3]), image_request("b", [3])
        claim_first(a, a_req)
        assert not step(b, b_req)
        assert not step(b, b_req)  # held by A
        a.request_finished(a_req)  # aborted before vLLM scheduled its encode
        assert a._scheduler.claims() == []
        assert lease_gone(fake_master, key)
        waited = steps_until_available(b, clock, b_req, limit_s=CLAIM_WAIT_S)
        assert waited < 1.0  # at its next look, long before the bound
        assert not b.has_cache_item("img-3")  # B won it: encoded there
        assert b._scheduler.claims() == [key.to_key()]
        assert b.totals()["claims_won"] == 1


def test_a_won_claim_whose_save_never_reports_ends_at_its_hold(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    cfg = config(fake_master.address)
    key = key_of(pixels(4))
    with connector(cfg, "scheduler") as a:
        a_req = image_request("a", [4])
        claim_first(a, a_req)
        a.update_state_after_alloc(a_req, 0)  # its save is planned ...
        a.build_connector_meta(SchedulerOutput.make_empty())
        a.request_finished(a_req)
        assert a._scheduler.claims() == [key.to_key()]  # ... so the claim waits for it
        hold = a._scheduler.claim_wait + TIMEOUT_S + 0.5
        clock.now += hold - 0.1
        a.build_connector_meta(SchedulerOutput.make_empty())
        assert a._scheduler.claims() == [key.to_key()]
        clock.now += 0.2  # no worker ever reported it (a step that ran no model, a lost save)
        a.build_connector_meta(SchedulerOutput.make_empty())
        assert a._scheduler.claims() == []
        assert lease_gone(fake_master, key)


def test_a_request_gives_back_a_claim_past_a_key_it_waits_for(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """Claims in key order: a request that won a key larger than one claimed elsewhere gives
    it back (its claimant may wait for it), and claims it again once the smaller one landed."""
    cfg = config(fake_master.address)
    seeds = sorted([5, 6], key=lambda s: key_of(pixels(s)).to_key())
    small, large = seeds
    with (
        another_client(fake_master) as other,
        connector(cfg, "scheduler") as a,
    ):
        assert other.claim([key_of(pixels(small))]) == [Claim.WON]
        req = image_request("a", [small, large])
        assert not step(a, req)
        assert not step(a, req)
        assert a._scheduler.claims() == []  # the larger key, won, was given back
        assert lease_gone(fake_master, key_of(pixels(large)))
        other.insert_batch([key_of(pixels(small))], [embedding(small)])
        other.release([key_of(pixels(small))])
        steps_until_available(a, clock, req, limit_s=CLAIM_WAIT_S)
        assert a.has_cache_item(f"img-{small}")  # the other's entry, loaded
        assert not a.has_cache_item(f"img-{large}")
        assert a._scheduler.claims() == [key_of(pixels(large)).to_key()]  # claimed again, in order


def test_a_request_keeps_a_claim_below_the_key_it_waits_for(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    cfg = config(fake_master.address)
    small, large = sorted([7, 8], key=lambda s: key_of(pixels(s)).to_key())
    with (
        another_client(fake_master) as other,
        connector(cfg, "scheduler") as a,
    ):
        assert other.claim([key_of(pixels(large))]) == [Claim.WON]
        req = image_request("a", [small, large])
        assert not step(a, req)
        assert not step(a, req)
        assert a._scheduler.claims() == [key_of(pixels(small)).to_key()]
        other.release([key_of(pixels(large))])


def same_image_twice(request_id: str, seed: int) -> Request:
    """A request naming the image of `seed` twice, as ``x`` and ``y`` (two uuids, one key)."""
    return request(
        request_id, [("x", "image", ROWS), ("y", "image", ROWS)], data={"x": pixels(seed), "y": pixels(seed)}
    )


def held_then_won(
    sched: MMKeyECConnector, other: MooncakeCache, master: FakeMooncakeMaster, clock: StepClock, seed: int
) -> Request:
    """``x`` of the image of `seed` found claimed elsewhere (held), then, the other claimant
    gone, ``y`` of the same image claimed here (each by a live request of its own); returns a
    request naming both, not asked yet."""
    key = key_of(pixels(seed))
    assert other.claim([key]) == [Claim.WON]
    assert not step(sched, request("first", [("x", "image", ROWS)], data={"x": pixels(seed)}))
    assert sched._scheduler._stager is not None and sched._scheduler._stager.state("x") is Staged.HELD
    other.release([key])
    assert lease_gone(master, key)
    assert not step(sched, request("second", [("y", "image", ROWS)], data={"y": pixels(seed)}))
    assert sched._scheduler.claims() == [key.to_key()]  # won under ``y``
    return same_image_twice("both", seed)


def test_an_item_held_under_one_uuid_and_won_under_another_is_encoded_without_waiting(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """A request naming one image under two uuids, one seen held before the other was claimed
    here, does not wait for itself: the image is encoded here at its next step."""
    with (
        another_client(fake_master) as other,
        connector(config(fake_master.address), "scheduler") as a,
    ):
        both = held_then_won(a, other, fake_master, clock, seed=9)
        clock.now += STEP_S
        assert not step(a, both)  # ``y`` asked again for this request
        assert step(a, both)  # at once, far before the claim's wait ends
        assert not a.has_cache_item("x") and not a.has_cache_item("y")
        assert a._scheduler.claims() == [key_of(pixels(9)).to_key()]
        assert "waited_out" not in a.totals()


def test_a_claim_under_another_uuid_that_ended_at_its_hold_no_longer_counts_as_won(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """Once the claim won under ``y`` ended at its hold (its save never came), the item held
    under ``x`` is waited for again, and claimed again, within the request's wait."""
    with (
        another_client(fake_master) as other,
        connector(config(fake_master.address), "scheduler") as a,
    ):
        key = key_of(pixels(10))
        both = held_then_won(a, other, fake_master, clock, seed=10)
        won_at = clock.now
        clock.now += 2.0  # the request's wait (3 s) begins 2 s after the claim: it outlasts the hold
        assert not step(a, both)  # ``y`` asked again for this request
        clock.now = won_at + CLAIM_WAIT_S + TIMEOUT_S + 0.5 + STEP_S
        a.build_connector_meta(SchedulerOutput.make_empty())  # the hold ends
        assert a._scheduler.claims() == []
        assert not step(a, both)  # still within its wait: waits for ``x``
        assert a._scheduler.claims() == [key.to_key()]  # ``x`` claimed again


def test_a_claim_given_back_is_looked_at_with_the_held_key_it_yields_to(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    """A request waiting for a smaller key claimed elsewhere, that then wins a larger key,
    gives it back and looks at it in the same step: an entry stored meanwhile (by an instance
    that does not claim) is loaded at once, not at the next look."""
    small, large = sorted([14, 15], key=lambda s: key_of(pixels(s)).to_key())
    with (
        another_client(fake_master) as other,
        connector(config(fake_master.address), "scheduler") as a,
    ):
        assert other.claim([key_of(pixels(small))]) == [Claim.WON]
        assert not step(a, image_request("first", [small]))  # seen held
        req = image_request("a", [small, large])
        assert not step(a, req)  # the larger key asked for the first time, and won
        assert a._scheduler.claims() == [key_of(pixels(large)).to_key()]
        other.insert_batch([key_of(pixels(large))], [embedding(large)])
        clock.now += 0.02  # the held key's first look is due
        assert not step(a, req)
        assert a._scheduler.claims() == []  # given back
        assert a.has_cache_item(f"img-{large}")  # looked at in the same step: loaded


def test_a_consumer_and_a_cache_without_claims_never_claim(
    clock: StepClock, fake_master: FakeMooncakeMaster
) -> None:
    for cfg in (config(fake_master.address, "ec_consumer"), config(fake_master.address, claim_wait=0)):
        with connector(cfg, "scheduler") as sched:
            req = image_request("r", [9])
            assert not step(sched, req)
            assert sched.ensure_cache_available(req, 0)
            assert sched._scheduler.claims() == [] and "claims_won" not in sched.totals()
            assert sched._scheduler.claim_wait == 0.0
    assert fake_master.calls["batch_put_session_start"] == 0


def test_the_workers_report_aggregates_and_crosses_processes() -> None:
    one, two = MMKeyECWorkerMetadata(frozenset({"a"})), MMKeyECWorkerMetadata(frozenset({"b"}))
    both = one.aggregate(two)
    assert both == MMKeyECWorkerMetadata(frozenset({"a", "b"}))
    assert pickle.loads(pickle.dumps(both)) == both


@pytest.mark.mooncake
def test_two_instances_on_a_real_master_encode_a_shared_image_once(mooncake_master: MasterProcess) -> None:
    """Real time, a real master: the second instance waits for the first's save and loads it."""
    cfg = vllm_config(
        "ec_both",
        namespace="single-flight",
        mooncake=mooncake_extra(mooncake_master, claim_wait=CLAIM_WAIT_S),
    )
    key = key_of(pixels(10))
    with (
        connector(cfg, "scheduler") as a,
        connector(cfg, "worker") as a_worker,
        connector(cfg, "scheduler") as b,
    ):
        a_req, b_req = image_request("a", [10]), image_request("b", [10])
        claim_first(a, a_req)
        assert not step(b, b_req)
        assert not step(b, b_req)
        stager = b._scheduler._stager
        assert stager is not None and stager.state("img-10") is Staged.HELD
        encode_and_save(a, a_worker, a_req, {"img-10": embedding(10)})
        assert a._scheduler.claims() == []
        assert wait_until(lambda: step(b, b_req), CLAIM_WAIT_S + 5.0, poll=0.005)
        assert b.has_cache_item("img-10")
        b.update_state_after_alloc(b_req, 0)
        meta = b.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata)
        assert [item.identifier for item in meta.loads] == ["img-10"]
        assert torch.equal(meta.loads[0].tensor, embedding(10))
        assert a.totals()["claims_won"] == 1 and b.totals()["waits_served"] == 1
        assert key.to_key() not in b._scheduler.claims()


def answered(stager: Stager, name: str) -> bool:
    return stager.state(name) is Staged.MISSING


def test_the_claims_a_stager_holds_are_bounded(clock: StepClock, fake_master: FakeMooncakeMaster) -> None:
    """Past `most` claims held, the oldest are released (each also ends at its hold)."""
    config = MooncakeConfig(
        master_server_address=fake_master.address, local_buffer_size=4 << 20, claim_wait=2.0
    )
    with MooncakeCache(config, store_class=FakeMooncakeStore) as cache:
        stager = Stager(cache, fetch=True, max_bytes=1 << 20, claims=True, hold_s=10.0, clock=clock)
        try:
            keys = [key_of(pixels(seed)) for seed in (11, 12, 13)]
            for i, key in enumerate(keys):
                name = f"img-{i}"
                stager.want(name, key, ROWS)
                assert wait_until(functools.partial(answered, stager, name), 10.0, poll=0.0005)
                clock.now += 1.0
            assert stager.claims() == [k.to_key() for k in keys]
            stager.expire_claims(most=1)
            assert stager.claims() == [keys[2].to_key()]
            assert lease_gone(fake_master, keys[0]) and lease_gone(fake_master, keys[1])
            clock.now += 10.0
            stager.expire_claims()
            assert stager.claims() == []
            assert lease_gone(fake_master, keys[2])
        finally:
            stager.close()
