"""A real vLLM engine (vLLM's CPU build) on repeated images: mmkey's connector, vLLM's own
`ECMooncakeConnector`, and no connector, side by side in one run.

Run in the engine environment: ``make bench-vllm`` (or ``python benchmarks/bench_vllm_engine.py``
there). Builds a random-weight LLaVA whose vision tower costs something on a CPU (CLIP, 224 px
images in 14 px patches: 256 image tokens; hidden 256, 6 layers) and a two-layer decoder,
starts a local master and one holder, and runs fresh engine processes (engine core in-process):

- none: no EC connector (vLLM's own in-engine encoder cache still reuses repeats);
- mmkey: `MMKeyECConnector` (``ec_both``), after another engine stored every image's embedding
  (the fleet case: an image seen anywhere is not encoded again);
- vLLM push: vLLM's `ECMooncakeConnector` as vLLM runs it, encoder and decoder split: an
  encode-only producer engine (``ec_producer``) and a consumer engine (``ec_consumer``), engine
  cores in their own processes, each request sent to both at once with a transfer id per image,
  as vLLM's disaggregation proxy does (the producer also gets the consumer's control address);
  the producer pushes each embedding into the consumer's registered memory over Mooncake's
  transfer engine (TCP, loopback). Timed on the consumer, from the moment both engines get the
  requests. On the CPU build's V1 model runner a consumer whose requests all wait on pushes
  never runs the connector that loads them (the note under the table says where), so a
  text-only request decodes beside them until they are done. Its store mode
  (``cross_encoder_cache``) needs the V2 model runner, which vLLM does not pick without Triton.

Workload, each in one engine (pair): 48 requests over 16 distinct images (each 3 times), one
``generate`` (requests/s), then 8 single requests of further images, one at a time (time to
first token: one output token each; stored beforehand for mmkey, pushed per request for vLLM).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINE_RUN = ROOT / "tests" / "integrations" / "vllm" / "vllm_engine_run.py"
sys.path.insert(0, str(ROOT))

from mmkey.testing.fleet import running_fleet  # noqa: E402
from tests.integrations.vllm.vllm_engine_model import build_tiny_llava  # noqa: E402

IMAGE = 224
DISTINCT, REPEATS, SINGLES = 16, 3, 8


def workload() -> list[list[dict[str, Any]]]:
    batch = [
        {"text": "USER: <image> describe the picture", "images": [i % DISTINCT]}
        for i in range(DISTINCT * REPEATS)
    ]
    singles = [[{"text": "USER: <image> what is in this image", "images": [100 + i]}] for i in range(SINGLES)]
    return [batch, *singles]


def engine_env() -> dict[str, str]:
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",  # Mooncake's transfer engine advertises this address: loopback only
        MC_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def launch(workdir: Path, name: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start one engine run (`tests/integrations/vllm/vllm_engine_run.py`) in a fresh process."""
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec = dict(spec, name=name)
    env = dict(engine_env(), **spec.pop("env", {}))
    spec_path.write_text(json.dumps(spec))
    with (workdir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, str(ENGINE_RUN), str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def collect(workdir: Path, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Wait for a run's process; its results (exit with its log's tail when it has none)."""
    try:
        proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out_path = workdir / f"{name}.out.json"
    if not out_path.exists():
        raise SystemExit(f"engine {name} failed:\n{(workdir / (name + '.log')).read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    if "start_error" in result:
        raise SystemExit(f"engine {name}: {result['start_error']}")
    return result


def run(workdir: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return collect(workdir, name, launch(workdir, name, spec))


def run_pair(
    workdir: Path, names: tuple[str, str], specs: tuple[dict[str, Any], dict[str, Any]], rounds: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two engines started together, each round released to both at once (a file barrier)."""
    barrier = workdir / ("barrier-" + "-".join(names))
    barrier.mkdir()
    procs = [
        launch(workdir, name, dict(spec, barrier_dir=str(barrier)))
        for name, spec in zip(names, specs, strict=True)
    ]
    try:
        for k in range(rounds + 1):  # and once more: neither stops while the other still needs it
            stop = time.monotonic() + 600
            while not all((barrier / f"{name}.ready-{k}").exists() for name in names):
                if any(p.poll() is not None for p in procs) or time.monotonic() > stop:
                    break
                time.sleep(0.001)
            (barrier / f"go-{k}").write_text("go")
    finally:
        results = tuple(collect(workdir, name, proc) for name, proc in zip(names, procs, strict=True))
    return results[0], results[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vllm_push_specs(
    base: dict[str, Any], rounds: list[list[dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The producer's and the consumer's specs for vLLM's `ECMooncakeConnector` in push mode.

    What vLLM's disaggregation proxy adds to a request: one transfer id per image, to both
    halves; the consumer's control address to the producer's half."""
    consumer_port = free_port()
    common = {
        "ec_connector": "ECMooncakeConnector",
        "ec_buffer_device": "cpu",
        "ec_buffer_size": 256 << 20,
        "ec_ip": "127.0.0.1",
        "ec_connector_extra_config": {"mooncake_protocol": "tcp", "push_wait_timeout_s": 10},
    }
    producer_ec = dict(common, ec_role="ec_producer", ec_port=free_port())
    consumer_ec = dict(common, ec_role="ec_consumer", ec_port=consumer_port)
    # the engine core in its own process, as ``vllm serve`` runs it: its loop keeps stepping
    # while pushes are in flight (`Scheduler.has_requests`), which an in-process `LLM` does not
    own_core = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    consumer_zmq = f"tcp://127.0.0.1:{consumer_port}"
    ids = [
        [[f"r{k}-p{i}-m{j}" for j in range(len(p["images"]))] for i, p in enumerate(rnd)]
        for k, rnd in enumerate(rounds)
    ]
    consumer_params = [[{"ec_items": [{"transfer_id": t} for t in req]} for req in rnd] for rnd in ids]
    producer_params = [[dict(p, consumer_zmq=consumer_zmq) for p in rnd] for rnd in consumer_params]
    # the consumer's requests all wait on pushes at first: a text-only request keeps its steps
    # busy, or vLLM's V1 model runner never runs the connector that loads them (see the note)
    return (
        dict(base, ec=producer_ec, round_params=producer_params, env=own_core),
        dict(base, ec=consumer_ec, round_params=consumer_params, env=own_core, keepalive=True),
    )


def source_line(module: str, needle: str) -> str:
    """``path:line`` (under site-packages) of the first line of `module` that contains `needle`."""
    import inspect

    import vllm

    loaded = importlib.import_module(module)
    lines, _ = inspect.getsourcelines(loaded)
    line = next(i for i, text in enumerate(lines, 1) if needle in text)
    return f"{Path(inspect.getfile(loaded)).relative_to(Path(vllm.__file__).parent.parent)}:{line}"


def vllm_modes_note() -> str:
    """What vLLM's connector needs on this build, from vLLM's own code (file:line)."""
    triton = importlib.util.find_spec("triton") is not None
    return (
        "push mode: the consumer defers each request until its push lands, so a step can schedule "
        "no token; vLLM's V1 model runner then returns before it runs the EC connector ("
        + source_line("vllm.v1.worker.gpu_model_runner", "if not num_scheduled_tokens:")
        + "), the load of a pushed embedding is never started and the request fails after "
        "`push_wait_timeout_s`; here a text-only request decodes beside them (one token a step) "
        "until they are done. The V2 runner runs the connector on such steps ("
        + source_line("vllm.v1.worker.gpu.model_runner", "return self._merge_ec_connector_no_forward(")
        + "). Store mode (`cross_encoder_cache`) is refused without the V2 runner ("
        + source_line("vllm.distributed.ec_transfer.ec_connector.mooncake.config", "requires Model Runner V2")
        + "). vLLM picks V1 when Triton is missing ("
        + source_line("vllm.config.vllm", "Model Runner V2 requires Triton")
        + f"); Triton importable here: {triton}."
    )


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="mmkey-bench-vllm-engine-"))
    measure(workdir)
    shutil.rmtree(workdir, ignore_errors=True)  # kept, with every engine's log, when a run fails


def measure(workdir: Path) -> None:
    model = build_tiny_llava(workdir / "model", image_size=IMAGE, patch=14, tower_hidden=256, tower_layers=6)
    rounds = workload()
    base = {"model": str(model), "rounds": rounds, "max_tokens": 1, "image_size": IMAGE}
    results: dict[str, dict[str, Any]] = {"none": run(workdir, "none", dict(base, ec=None))}
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
        warm = run(workdir, "warm", dict(base, ec=ec))  # another engine stores every image
        results["mmkey"] = run(workdir, "mmkey", dict(base, ec=ec))
    producer, results["vLLM push (E->PD)"] = run_pair(
        workdir, ("vllm-producer", "vllm-consumer"), vllm_push_specs(base, rounds), len(rounds)
    )
    print(
        f"{DISTINCT * REPEATS} requests over {DISTINCT} images ({IMAGE} px, 256 image tokens each), "
        f"then {SINGLES} single requests; tower: CLIP hidden 256 x 6 layers; 2 shared cores\n"
    )
    print(
        "| connector | requests/s | time to first token (median of 8) "
        "| images the tower encoded | requests failed |"
    )
    print("|---|---|---|---|---|")
    reference = [[r["tokens"] for r in rnd] for rnd in results["none"]["rounds"]]
    for name, result in results.items():
        seconds = result["round_seconds"]
        got = [[r["tokens"] for r in rnd] for rnd in result["rounds"]]
        # a failed request has no tokens; every served one equals the reference token for token
        failed = sum(t == [] for rnd in got for t in rnd)
        assert all(
            t in ([], want)
            for rnd, ref in zip(got, reference, strict=True)
            for t, want in zip(rnd, ref, strict=True)
        ), name
        assert name.startswith("vLLM") or failed == 0, name
        rate = DISTINCT * REPEATS / seconds[0]
        ttft = statistics.median(seconds[1:]) * 1e3
        encoded = str(result["tower_images"])
        if name.startswith("vLLM"):
            encoded = f"{encoded} (its producer: {producer['tower_images']})"
        print(f"| {name} | {rate:.1f} | {ttft:.1f} ms | {encoded} | {failed} |")
    print(
        f"\n(the storing engine encoded {warm['tower_images']} images; every served request's "
        "tokens equal the run without a connector; a failed request got no tokens after waiting "
        "`push_wait_timeout_s` (10 s) for its push; vLLM push: two engines on the same 2 cores, "
        "timed on the consumer from the moment both get the requests)"
    )
    print(f"vLLM's connector: {vllm_modes_note()}")


if __name__ == "__main__":
    main()
