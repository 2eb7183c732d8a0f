"""A real vLLM engine (vLLM's CPU build) on repeated images: with mmkey's connector and without.

Run in the engine environment: ``make bench-vllm`` (or ``python benchmarks/bench_vllm_engine.py``
there). Builds a random-weight LLaVA whose vision tower costs something on a CPU (CLIP, 224 px
images in 14 px patches: 256 image tokens; hidden 256, 6 layers) and a two-layer decoder,
starts a local master and one holder, and runs fresh engine processes (engine core in-process):

- none: no EC connector (vLLM's own in-engine encoder cache still reuses repeats);
- mmkey: `MMKeyECConnector` (``ec_both``), after another engine stored every image's embedding
  (the fleet case: an image seen anywhere is not encoded again).

Workload, each in one engine: 48 requests over 16 distinct images (each 3 times), one
``generate`` (requests/s), then 8 single requests of further stored images, one at a time
(time to first token: one output token each). vLLM's own ``ECMooncakeConnector`` pushes
embeddings from one producer engine to a consumer per request, reserved through its proxy's
transfer ids, and its store mode needs the V2 model runner, which the CPU build does not run:
it has no row here.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from vllm_engine_model import build_tiny_llava  # noqa: E402

from mmkey.testing.fleet import running_fleet  # noqa: E402

IMAGE = 224
DISTINCT, REPEATS, SINGLES = 16, 3, 8


def workload() -> list[list[dict[str, Any]]]:
    batch = [{"text": "USER: <image> describe the picture", "images": [i % DISTINCT]} for i in range(DISTINCT * REPEATS)]
    singles = [[{"text": "USER: <image> what is in this image", "images": [100 + i]}] for i in range(SINGLES)]
    return [batch, *singles]


def run(workdir: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        MC_LOG_LEVEL="ERROR",
        PYTHONPATH=str(TESTS),
    )
    with (workdir / f"{name}.log").open("wb") as log:
        subprocess.run([sys.executable, str(TESTS / "vllm_engine_run.py"), str(spec_path), str(out_path)],
                       env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    if not out_path.exists():
        raise SystemExit(f"engine {name} failed:\n{(workdir / (name + '.log')).read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    if "start_error" in result:
        raise SystemExit(f"engine {name}: {result['start_error']}")
    return result


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="mmkey-bench-vllm-engine-"))
    try:
        measure(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(workdir: Path) -> None:
    model = build_tiny_llava(workdir / "model", image_size=IMAGE, patch=14, tower_hidden=256, tower_layers=6)
    rounds = workload()
    with running_fleet(holders=1, segment_size=512 << 20) as fleet:
        ec = {
            "ec_connector": "MMKeyECConnector",
            "ec_connector_module_path": "mmkey.integrations.vllm",
            "ec_role": "ec_both",
            "ec_connector_extra_config": {
                "mooncake": {
                    "master_server_address": fleet.master.address,
                    "global_segment_size": 0,
                    "local_buffer_size": "128MB",
                }
            },
        }
        base = {"model": str(model), "rounds": rounds, "max_tokens": 1, "image_size": IMAGE}
        results = {"none": run(workdir, "none", dict(base, ec=None))}
        warm = run(workdir, "warm", dict(base, ec=ec))  # another engine stores every image
        results["mmkey"] = run(workdir, "mmkey", dict(base, ec=ec))
    print(f"{DISTINCT * REPEATS} requests over {DISTINCT} images ({IMAGE} px, 256 image tokens each), "
          f"then {SINGLES} single requests; tower: CLIP hidden 256 x 6 layers; 2 shared cores\n")
    print("| connector | requests/s | time to first token (median of 8) | images the tower encoded |")
    print("|---|---|---|---|")
    reference = results["none"]["rounds"]
    for name, result in results.items():
        seconds = result["round_seconds"]
        assert [[r["tokens"] for r in rnd] for rnd in result["rounds"]] == [[r["tokens"] for r in rnd] for rnd in reference]
        rate = DISTINCT * REPEATS / seconds[0]
        ttft = statistics.median(seconds[1:]) * 1e3
        print(f"| {name} | {rate:.1f} | {ttft:.1f} ms | {result['tower_images']} |")
    print(f"\n(the storing engine encoded {warm['tower_images']} images; outputs equal token for token)")


if __name__ == "__main__":
    main()
