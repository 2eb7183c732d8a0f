"""`MMKeyECConnector` against hostile clients: a request's wait is bounded whatever its
``ec_transfer_params`` say and whatever other requests do, and a reused identifier
(``multi_modal_uuids``) never serves another image's embedding.

The waits run on a clock the test moves (the connector's ``_clock``); the stager's answers
come from its own thread, so each step waits until they are filed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import (
    StepClock,
    connector,
    install_step_clock,
    mooncake_extra,
    produce,
    request,
    require_vllm,
    schedule,
    until_available,
    vllm_config,
)

require_vllm()

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

from mmkey import EmbeddingKey, HashScheme, Modality  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector, MMKeyECMetadata  # noqa: E402
from mmkey.integrations.vllm._connector_settings import content_digest  # noqa: E402
from mmkey.integrations.vllm._stager import Staged  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.request import Request

HIDDEN = 32
STEP_S = 0.01
"""The time one engine step takes on the test's clock."""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    return install_step_clock(monkeypatch)


def pixels(seed: int) -> torch.Tensor:
    return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def embedding(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


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


def steps_until_available(
    sched: MMKeyECConnector, clock: StepClock, req: Request, *, honest: bool, limit_s: float
) -> tuple[int, float]:
    """Call `ensure_cache_available` once a step as vLLM does, the clock moving `STEP_S` a
    step, until it says yes; with `honest`, a new request beside it each step whose lookup is
    answered. The steps that deferred `req` and the time it waited (fails past `limit_s`)."""
    names = [f.identifier for f in req.mm_features]
    start = clock.now
    deferred = 0
    while not sched.ensure_cache_available(req, 0):
        deferred += 1
        assert clock.now - start < limit_s, f"deferred {deferred} steps, past its bound"
        if honest:
            other = request(f"honest-{deferred}", [(f"honest-img-{deferred}", "image", 4)])
            sched.ensure_cache_available(other, 0)
            settle(sched, [f"honest-img-{deferred}"])
            sched.request_finished(other)
        settle(sched, names)
        clock.now += STEP_S
    return deferred, clock.now - start


def count_lookups(monkeypatch: pytest.MonkeyPatch, sched: MMKeyECConnector, key: EmbeddingKey) -> list[int]:
    """How many store reads named `key` (one counter, in a list)."""
    seen = [0]
    real = sched.cache.get_embeddings

    def counting(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        seen[0] += sum(1 for k in keys if k == key)
        return real(keys)

    monkeypatch.setattr(sched.cache, "get_embeddings", counting)
    return seen


@pytest.mark.parametrize("honest", [False, True], ids=["alone", "beside-honest-traffic"])
def test_a_request_announcing_its_own_unstored_image_is_released_within_its_bound(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch, honest: bool
) -> None:
    """A client's ``ec_transfer_params`` name its own image's key, which no producer stores:
    the request waits ``producer_wait_s`` from its first deferral, however often its own
    retries or other requests' lookups are answered, then is encoded here."""
    cfg = vllm_config("ec_both", namespace="stall", store="memory", producer_wait_s=2.0)
    image = pixels(1)
    forged = {"mmkey": {"encoded": [own_key("stall", image).to_key()]}}
    with connector(cfg, "scheduler") as sched:
        lookups = count_lookups(monkeypatch, sched, own_key("stall", image))
        req = request("forged", [("img", "image", 4)], data={"img": image}, ec_transfer_params=forged)
        deferred, waited = steps_until_available(sched, clock, req, honest=honest, limit_s=10.0)
        assert 1.9 <= waited <= 2.0 + 2 * STEP_S  # the producer's wait, from the first deferral
        assert not sched.has_cache_item("img")  # encoded here
        assert sched.ensure_cache_available(req, 0)  # and never deferred again
        assert lookups[0] <= 16  # retries back off: not one every 20 ms (100 in 2 s)
        assert sched.totals()["waited_out"] == 1


def test_retries_of_an_announced_item_are_capped_however_long_the_wait(
    clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = vllm_config("ec_both", namespace="capped", store="memory", producer_wait_s=60.0)
    image = pixels(2)
    forged = {"mmkey": {"encoded": [own_key("capped", image).to_key()]}}
    with connector(cfg, "scheduler") as sched:
        lookups = count_lookups(monkeypatch, sched, own_key("capped", image))
        req = request("forged", [("img", "image", 4)], data={"img": image}, ec_transfer_params=forged)
        _, waited = steps_until_available(sched, clock, req, honest=False, limit_s=70.0)
        assert waited <= 60.0 + 2 * STEP_S
        assert lookups[0] <= 33  # the first lookup and at most 32 retries, not 3,000


FOREIGN = own_key("another-model", pixels(3))
"""The key of the request's own image, under another model's namespace."""


@pytest.mark.parametrize(
    "params",
    [
        {"mmkey": {"encoded": [FOREIGN.to_key()]}},
        {"mmkey": {"encoded": "mmk1@not-a-list"}},
        {"mmkey": {"encoded": [7, None, ["x"], {"k": 1}, "mmk1@broken", "x" * 100_000]}},
        {"mmkey": ["encoded"]},
        {"mmkey": "encoded"},
        ["mmkey"],
        "mmkey",
        {"mmkey": {"encoded": [FOREIGN.to_key()] * 5000}},
    ],
    ids=[
        "foreign-namespace",
        "not-a-list",
        "junk-items",
        "list",
        "text",
        "params-list",
        "params-text",
        "flood",
    ],
)
def test_foreign_and_malformed_announcements_are_ignored(clock: StepClock, params: Any) -> None:
    """Announcements that name no key of this connector's namespace, or are not the
    producer's shape at all, neither raise nor defer the request past its lookup (the clock
    stands still: only a wait that ends by itself lets it through); they are counted."""
    cfg = vllm_config("ec_both", namespace="mine", store="memory", producer_wait_s=5.0)
    with connector(cfg, "scheduler") as sched:
        req = request("r", [("img", "image", 4)], data={"img": pixels(3)}, ec_transfer_params=params)
        while not sched.ensure_cache_available(req, 0):
            settle(sched, ["img"])
            assert sched.ensure_cache_available(req, 0), "deferred after its lookup was answered"
        assert not sched.has_cache_item("img")
        assert sched.totals()["announcements_ignored"] == 1


@pytest.fixture
def entry_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fleet entry secret in ``MMKEY_ENTRY_KEY_FILE`` for the caches made in the test."""
    path = tmp_path / "entry.key"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    monkeypatch.setenv("MMKEY_ENTRY_KEY_FILE", str(path))
    monkeypatch.delenv("MMKEY_ENTRY_AUTH", raising=False)
    yield


@pytest.mark.mooncake
def test_under_a_fleet_secret_only_a_producers_signed_announcement_is_waited_for(
    clock: StepClock, mooncake_master: MasterProcess, entry_key_file: None
) -> None:
    """With an entry secret, a producer signs what it announces; a consumer waits only for a
    signed announcement: the same keys unsigned, or with a mac of other keys, are ignored."""
    store = mooncake_extra(mooncake_master)
    cfg = vllm_config("ec_both", namespace="signed", mooncake=store, producer_wait_s=5.0)
    image = pixels(4)
    with connector(cfg, "scheduler") as producer:
        req = request("p", [("img", "image", 4)], data={"img": image})
        until_available(producer, req)
        producer.update_state_after_alloc(req, 0)
        producer.build_connector_meta(SchedulerOutput.make_empty())
        _, signed = producer.request_finished(req)
    assert signed is not None
    announced = signed["mmkey"]
    assert announced["encoded"] == [own_key("signed", image).to_key()] and "mac" in announced
    unsigned = {"mmkey": {"encoded": announced["encoded"]}}
    other = own_key("signed", pixels(5)).to_key()
    swapped = {"mmkey": {**announced, "encoded": [*announced["encoded"], other]}}
    with connector(cfg, "scheduler") as consumer:
        for name, params in (("unsigned", unsigned), ("swapped", swapped)):
            c_req = request(name, [("img", "image", 4)], data={"img": image}, ec_transfer_params=params)
            while not consumer.ensure_cache_available(c_req, 0):
                settle(consumer, ["img"])
                assert consumer.ensure_cache_available(c_req, 0), f"{name}: waited for a forged announcement"
            consumer.request_finished(c_req)
        assert consumer.totals()["announcements_ignored"] == 2
        c_req = request("genuine", [("img", "image", 4)], data={"img": image}, ec_transfer_params=signed)
        assert not consumer.ensure_cache_available(c_req, 0)
        settle(consumer, ["img"])
        assert not consumer.ensure_cache_available(c_req, 0)  # answered missing: waits for the producer
        consumer.request_finished(c_req)


def save(
    sched: MMKeyECConnector, worker: MMKeyECConnector, req: Request, tensor: torch.Tensor
) -> EmbeddingKey:
    """Schedule `req` (one item, not stored) and save `tensor` as its encoder output."""
    meta, hits = schedule(sched, [req])
    assert hits == []
    identifier = req.mm_features[0].identifier
    produce(worker, meta, {identifier: tensor})
    assert worker.flush_saves(10.0)
    return meta.saves[identifier]


@pytest.mark.parametrize("first,second", [(11, 12), (12, 11)], ids=["victim-first", "attacker-first"])
def test_a_reused_uuid_on_one_instance_never_serves_another_image(first: int, second: int) -> None:
    """Two images under one ``multi_modal_uuids`` value, in either order: each is keyed by
    its own content every time, so neither is ever served for the other."""
    cfg = vllm_config("ec_both", namespace="uuid-one", store="memory")
    uuid = "user-a-photo"
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        key_first = save(
            sched, worker, request("a", [(uuid, "image", 4)], data={uuid: pixels(first)}), embedding(4, first)
        )
        assert key_first == own_key("uuid-one", pixels(first))
        meta, hits = schedule(sched, [request("b", [(uuid, "image", 4)], data={uuid: pixels(second)})])
        assert hits == [] and meta.saves[uuid] == own_key("uuid-one", pixels(second))
        produce(worker, meta, {uuid: embedding(4, second)})
        assert worker.flush_saves(10.0)
        for seed in (first, second, first):  # each image finds its own entry, whatever came before
            meta, hits = schedule(
                sched, [request(f"again-{seed}", [(uuid, "image", 4)], data={uuid: pixels(seed)})]
            )
            assert hits == [uuid] and torch.equal(meta.loads[0].tensor, embedding(4, seed))


@pytest.mark.parametrize("first,second", [(21, 22), (22, 21)], ids=["victim-first", "attacker-first"])
def test_a_reused_uuid_across_instances_never_serves_another_image_or_tenant(first: int, second: int) -> None:
    """Two connector instances share a store. An image under a uuid one instance saved is
    never served for another image under that uuid on the other; an item vLLM sends without
    its data (a uuid it cached) is keyed by its identifier scoped by the request's
    ``cache_salt`` and LoRA adapter: another tenant's salt or adapter never reaches it."""
    cfg = vllm_config("ec_both", namespace="uuid-two", store="memory")
    uuid = "shared-photo"
    with connector(cfg, "scheduler") as one, connector(cfg, "worker") as worker:
        save(one, worker, request("a", [(uuid, "image", 4)], data={uuid: pixels(first)}), embedding(4, first))
        bare = request("bare", [("cached-uuid", "image", 4)], cache_salt="tenant-a")  # no data
        save(one, worker, bare, embedding(4, first))
        with connector(cfg, "scheduler") as two:
            _, hits = schedule(two, [request("b", [(uuid, "image", 4)], data={uuid: pixels(second)})])
            assert hits == []
            for salt, lora in (("tenant-b", None), (None, None), ("tenant-a", "adapter-1")):
                _, hits = schedule(
                    two, [request("c", [("cached-uuid", "image", 4)], cache_salt=salt, lora_name=lora)]
                )
                assert hits == [], (salt, lora)
            meta, hits = schedule(two, [request("d", [("cached-uuid", "image", 4)], cache_salt="tenant-a")])
            assert hits == ["cached-uuid"]  # the same tenant shares its own
            meta, hits = schedule(two, [request("e", [(uuid, "image", 4)], data={uuid: pixels(first)})])
            assert hits == [uuid] and torch.equal(meta.loads[0].tensor, embedding(4, first))


def test_two_images_under_one_uuid_in_one_step_are_neither_claimed_nor_saved() -> None:
    """Two live requests name one identifier with different images: vLLM keys its encoder
    cache by the identifier, so the connector claims neither and saves neither (an output
    saved under the other image's key would poison it)."""
    cfg = vllm_config("ec_both", namespace="uuid-step", store="memory")
    uuid = "twice"
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        save(sched, worker, request("a", [(uuid, "image", 4)], data={uuid: pixels(31)}), embedding(4, 31))
        x = request("x", [(uuid, "image", 4)], data={uuid: pixels(31)})
        y = request("y", [(uuid, "image", 4)], data={uuid: pixels(32)})
        until_available(sched, x)
        until_available(sched, y)
        assert not sched.has_cache_item(uuid)
        sched.update_state_after_alloc(x, 0)
        sched.update_state_after_alloc(y, 0)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata)
        assert meta.loads == () and meta.saves == {}
        sched.request_finished(x)
        sched.request_finished(y)
        _, hits = schedule(sched, [request("z", [(uuid, "image", 4)], data={uuid: pixels(31)})])
        assert hits == [uuid]  # once one request is left, it is served again
