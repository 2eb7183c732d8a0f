"""mmkey's vLLM connector against vLLM's own Mooncake encoder store, on one master, one run.

Run in vLLM's environment: ``make bench-vllm`` (or ``python benchmarks/bench_vllm.py`` there).
Starts a local master and a separate segment holder (``mooncake_client``) on 127.0.0.1; both
sides are pure clients of it, so every write and read crosses TCP as between serving nodes.

- mmkey: `MMKeyECConnector` made from a real `VllmConfig` (a scheduler side and two worker
  sides: the producer that saves, the consumer that loads), timeout 5 s (vLLM's has none).
- vLLM: `MooncakeEmbeddingStoreClient` (``vllm.distributed.ec_transfer.ec_connector.
  mooncake_store_embedding``), the client behind vLLM's encoder-side store: keys from
  ``make_embedding_key``, a 24-byte header, no checksum.

Operations, 64 identifiers (hex text like vLLM's ``mm_hash``), 64 embeddings of
1024 x 3584 bf16 (7 MiB each, 448 MiB in all):
- what the scheduler's step pays for 64 hits: mmkey ``ensure_cache_available`` of a request
  whose items are staged plus 64 ``has_cache_item`` (no store call: the fetches ran earlier,
  off the step), against ``batch_exists`` of 64 keys (a store call on the step);
- save 64: mmkey ``save_caches`` x 64 until the background saver has stored them (and how
  long ``save_caches`` held the caller), against ``put_tensor`` x 64 (vLLM's publisher thread
  calls it one item at a time);
- load 64: from ``ensure_cache_available`` (the fetches start, verified, into staging) until it
  says yes, then the plan and ``start_load_caches``, against ``load_tensors`` of 64 specs;
- content keys: what keying an item by its processed inputs costs the scheduler per image,
  once per identifier (``content_digest`` of LLaVA-1.5's 336 px ``pixel_values`` and of
  Qwen2-VL's patches of a 896 px image).
Lookups: best of 3, each round 64 new identifiers; loads: best of 5; saves: best of 2
(each round new identifiers).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any, cast

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import blake3  # noqa: E402
import torch  # noqa: E402

from _common import best, segment_holder  # noqa: E402
from mmkey.testing.mooncake_master import running_master  # noqa: E402

DEFER_LIMIT_S = 30.0


def until_available(sched: object, req: object) -> None:
    """`ensure_cache_available` once a step, as vLLM calls it, until it says yes."""
    stop = time.monotonic() + DEFER_LIMIT_S
    while not sched.ensure_cache_available(req, 0):  # type: ignore[attr-defined]
        assert time.monotonic() < stop
        time.sleep(0.0002)


MiB = 1 << 20
COUNT = 64
ROWS, HIDDEN = 1024, 3584


def row(name: str, vllm_s: float, mmkey_s: float, note: str = "") -> None:
    print(f"| {name} | {vllm_s * 1e3:.2f} ms | {mmkey_s * 1e3:.2f} ms | {mmkey_s / vllm_s:.2f}x | {note} |")


def identifiers(tag: str) -> list[str]:
    return [blake3.blake3(f"{tag}-{i}".encode()).hexdigest() for i in range(COUNT)]


def main() -> None:
    warnings.filterwarnings("ignore")
    import mooncake.store
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        TensorSpec,
        make_embedding_key,
    )
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
        MooncakeEmbeddingStoreClient,
    )
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from mmkey.integrations.vllm import MMKeyECConnector, MMKeyECMetadata

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(ROWS, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(COUNT)]
    nbytes = tensors[0].numel() * tensors[0].element_size()

    def request(ids: list[str]) -> Request:
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=ident,
                mm_position=PlaceholderRange(offset=1 + i * (ROWS + 1), length=ROWS),
            )
            for i, ident in enumerate(ids)
        ]
        return Request(
            "bench", [0] * (COUNT * (ROWS + 1) + 2), SamplingParams(max_tokens=1), None, mm_features=features
        )

    with running_master() as master, segment_holder(master.address, "3GB"):
        config = VllmConfig(
            ec_transfer_config=ECTransferConfig(
                ec_connector="MMKeyECConnector",
                ec_connector_module_path="mmkey.integrations.vllm",
                ec_role="ec_both",
                ec_connector_extra_config={
                    "namespace": "bench-model@main",
                    "mooncake": {
                        "master_server_address": master.address,
                        "global_segment_size": 0,
                        "local_buffer_size": "256MB",
                        # vLLM's client waits as long as a call takes; on 2 busy cores a
                        # 64 MiB transfer can pass the default 0.5 s
                        "timeout": 5.0,
                    },
                },
            )
        )
        sched = MMKeyECConnector(config, ECConnectorRole.SCHEDULER)
        producer = MMKeyECConnector(config, ECConnectorRole.WORKER)
        consumer = MMKeyECConnector(config, ECConnectorRole.WORKER)
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 256 * MiB, "tcp", "", master.address) == 0
        replicate = ReplicateConfig()
        # as vLLM's create_mooncake_embedding_store_client sets it (neither name is in mmkey's stubs)
        cast(Any, replicate).data_type = cast(Any, mooncake.store).ObjectDataType.TENSOR
        client = MooncakeEmbeddingStoreClient(raw, replicate, read_buffer_bytes=256 * MiB)
        namespace = "embedding@model:bench-model@revision:main@encoder:bench@dtype:torch.bfloat16@protocol:v3"
        try:
            print(
                f"vLLM {__import__('vllm').__version__}, {COUNT} x {ROWS} x {HIDDEN} bf16 "
                f"({nbytes / MiB:.0f} MiB each)\n"
            )
            print("| operation | vLLM's store client | mmkey connector | mmkey / vLLM | note |")
            print("|---|---|---|---|---|")

            # -- saves (each round new identifiers: vLLM's put never overwrites) ---------------
            rounds = iter(range(100))
            held: list[float] = []
            saved_ids: list[str] = []

            def mmkey_save() -> None:
                ids = identifiers(f"mmkey-save-{next(rounds)}")
                req = request(ids)
                until_available(sched, req)
                for i in range(COUNT):
                    sched.has_cache_item(ids[i])
                    sched.update_state_after_alloc(req, i)
                meta = sched.build_connector_meta(SchedulerOutput.make_empty())
                sched.request_finished(req)
                start = time.perf_counter()
                producer.bind_connector_metadata(meta)
                cache = dict(zip(ids, tensors, strict=True))
                for ident in ids:
                    producer.save_caches(cache, ident)
                producer.clear_connector_metadata()
                held.append(time.perf_counter() - start)
                assert producer.flush_saves(120.0)
                saved_ids[:] = ids

            vllm_ids: list[str] = []

            def vllm_save() -> None:
                ids = identifiers(f"vllm-save-{next(rounds)}")
                for ident, tensor in zip(ids, tensors, strict=True):
                    client.put_tensor(make_embedding_key(namespace, ident), tensor)
                vllm_ids[:] = ids

            t_vllm = best(vllm_save, 2)
            t_mmkey = best(mmkey_save, 2)
            totals = producer.totals()
            assert totals.get("saved", 0) + totals.get("save_failures", 0) == 2 * COUNT, totals
            failed = f"; {totals['save_failures']} timed out" if totals.get("save_failures") else ""
            row(
                f"save {COUNT} embeddings (until stored)",
                t_vllm,
                t_mmkey,
                f"mmkey's save_caches held the model step {min(held) * 1e3:.1f} ms for all {COUNT}{failed}",
            )

            # -- lookups: each round new identifiers whose entries exist on both sides (tiny)
            tiny = torch.ones(1, 8, dtype=torch.bfloat16)
            rounds_ids = [identifiers(f"lookup-{r}") for r in range(6)]

            def tiny_request(ids: list[str]) -> Request:
                features = [
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=ident,
                        mm_position=PlaceholderRange(offset=1 + i * 2, length=1),
                    )
                    for i, ident in enumerate(ids)
                ]
                return Request(
                    "tiny", [0] * (COUNT * 2 + 2), SamplingParams(max_tokens=1), None, mm_features=features
                )

            for ids in rounds_ids:
                req = tiny_request(ids)
                until_available(sched, req)
                for i in range(COUNT):
                    sched.update_state_after_alloc(req, i)
                meta = sched.build_connector_meta(SchedulerOutput.make_empty())
                sched.request_finished(req)
                producer.bind_connector_metadata(meta)
                for ident in ids:
                    producer.save_caches({ident: tiny}, ident)
                    client.put_tensor(make_embedding_key(namespace, ident), tiny)
                producer.clear_connector_metadata()
            assert producer.flush_saves(60.0)
            mmkey_rounds, vllm_rounds = iter(rounds_ids[0::2]), iter(rounds_ids[1::2])
            staged_requests = []
            for ids in rounds_ids[0::2]:  # staged before the step, as vLLM's earlier steps do
                req = tiny_request(ids)
                until_available(sched, req)
                staged_requests.append(req)
            mmkey_requests = iter(staged_requests)

            def mmkey_lookup() -> None:
                ids = next(mmkey_rounds)
                assert sched.ensure_cache_available(next(mmkey_requests), 0)
                assert all(sched.has_cache_item(i) for i in ids)

            def vllm_lookup() -> None:
                ids = next(vllm_rounds)
                assert all(client.batch_exists([make_embedding_key(namespace, i) for i in ids]))

            row(
                f"scheduler step, {COUNT} hits",
                best(vllm_lookup, 3),
                best(mmkey_lookup, 3),
                "mmkey: ensure_cache_available + has_cache_item x 64, staged; vLLM: batch_exists",
            )
            for req in staged_requests:
                sched.request_finished(req)

            # -- loads ---------------------------------------------------------------------------
            vllm_keys = [make_embedding_key(namespace, i) for i in vllm_ids]
            load_rounds = iter(range(100))

            def mmkey_load() -> None:
                req = request(saved_ids)
                req.request_id = f"load-{next(load_rounds)}"
                until_available(sched, req)
                for i in range(COUNT):
                    assert sched.has_cache_item(saved_ids[i])
                    sched.update_state_after_alloc(req, i)
                plan = sched.build_connector_meta(SchedulerOutput.make_empty())
                sched.request_finished(req)
                assert isinstance(plan, MMKeyECMetadata) and len(plan.loads) == COUNT
                encoder_cache: dict[str, torch.Tensor] = {}
                consumer.bind_connector_metadata(plan)
                consumer.start_load_caches(encoder_cache)
                consumer.clear_connector_metadata()
                assert len(encoder_cache) == COUNT
                # the first two loaded against the tensors they were saved from (the rest unchecked)
                pairs = zip(saved_ids[:2], tensors, strict=False)
                assert all(torch.equal(encoder_cache[i], t) for i, t in pairs)

            specs = {k: TensorSpec((ROWS, HIDDEN), "torch.bfloat16", nbytes) for k in vllm_keys}

            def vllm_load() -> None:
                assert len(client.load_tensors(specs, "cpu")) == COUNT

            row(
                f"load {COUNT} embeddings",
                best(vllm_load, 5),
                best(mmkey_load, 5),
                "mmkey fetches off the step and verifies every entry (checksum, key, dtype, shape)",
            )

            # -- content keys --------------------------------------------------------------------
            from mmkey.integrations.vllm._connector_settings import content_digest

            print()
            print("| processed inputs of one image | content_digest (once per identifier) |")
            print("|---|---|")
            for name, pixels in [
                ("LLaVA-1.5, 336 px: pixel_values 3 x 336 x 336 f32", torch.rand(3, 336, 336)),
                ("Qwen2-VL, 896 px: 4096 patches x 1176 f32", torch.rand(4096, 1176)),
            ]:
                inputs = {"pixel_values": pixels}
                t = best(functools.partial(content_digest, inputs), 5)
                print(f"| {name} ({pixels.numel() * 4 / MiB:.1f} MiB) | {t * 1e3:.2f} ms |")
        finally:
            sched.shutdown()
            producer.shutdown()
            consumer.shutdown()
            client.close()


if __name__ == "__main__":
    main()
