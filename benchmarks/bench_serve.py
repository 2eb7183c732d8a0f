"""What a user gains, served as users serve: ``vllm serve`` behind its OpenAI HTTP API.

Run in the vLLM engine environment (``make bench-serve``, or ``python benchmarks/bench_serve.py
[--quick]`` there). Builds a random-weight LLaVA whose vision tower costs what a real one does
(CLIP at 336 px in 14 px patches, 576 image tokens, ViT-B's width: hidden 768, 12 heads, with
as many layers as make one image cost about 200 ms on one core of this CPU, measured at start
(`calibrated_layers`): a 7B VLM's tower per high-resolution image on a GPU) and a two-layer
decoder; nothing is downloaded. Every configuration runs two engines (the fleet:
requests alternate between them) on one machine, each answering streamed
``/v1/chat/completions`` (2 output tokens); a load generator of its own (`loadgen`) replays a
seeded trace with Zipf-like image reuse at 1, 4 and 16 concurrent clients. Rows:

- none: no connector, every request's image under a fresh ``uuid`` (vLLM reuses nothing);
- in-engine: no connector (vLLM's own encoder and processor caches, per engine);
- vLLM store: vLLM's ``ECExampleConnector`` (0.32's shared-storage connector: safetensors
  files in a directory both engines share);
- mmkey: ``MMKeyECConnector`` (``ec_both``) on a local Mooncake master and one holder.

Every configuration's engines run at once, and each cell runs all rows back to back, the first
row turning from cell to cell (`loadgen.interleaved`): a shared host's speed drifts over
minutes, and rows run minutes apart compared that drift. At one client, where p99 is close to
the slowest request, the rows take turns request by request (`loadgen.turns`; in-engine, on
none's engines, runs after them) and every engine runs on one core, the rest of the benchmark
on the other (`loadgen.servers_on_one_core`): the speed of this host's cores drifts within
seconds and differs between them. Then mmkey with its holder paused (SIGSTOP: a store that
stops answering). Tower runs and tower time come from a forward hook in each engine
(`serve_worker`), bytes moved from the connector calls there; the hit path (lookup, fetch,
verify) is timed on the same store with an entry of the tower's output size. Absolute times are
this CPU's; ratios are the claim."""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
import serve_tables  # noqa: E402

IMAGE, PATCH = 336, 14
HIDDEN, HEADS, MLP = 768, 12, 3072
"""The tower's width: ViT-B/16's (CLIP ViT-B), at 336 px in 14 px patches."""
TOWER_TARGET_MS = 200.0
"""What one image's tower run should cost: its layer count is calibrated to it on this CPU."""
MAX_LAYERS = 24
IMAGE_TOKENS = (IMAGE // PATCH) ** 2


def calibrated_layers(target_ms: float = TOWER_TARGET_MS) -> tuple[int, float]:
    """How many ViT-B-wide layers make one image's tower cost about `target_ms` on one core of
    this CPU in bfloat16 (the engines' dtype), and one layer's median ms: hosts differ several
    times over (bfloat16 matrix units or none), and a tower far below 100 ms is a toy."""
    import importlib

    import torch

    CLIPVisionConfig: Any = importlib.import_module("transformers").CLIPVisionConfig
    CLIPEncoderLayer: Any = importlib.import_module("transformers.models.clip.modeling_clip").CLIPEncoderLayer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = CLIPVisionConfig(
            hidden_size=HIDDEN,
            intermediate_size=MLP,
            num_attention_heads=HEADS,
            image_size=IMAGE,
            patch_size=PATCH,
        )
        config._attn_implementation = "sdpa"
        layer = CLIPEncoderLayer(config).to(torch.bfloat16).eval()
        x = torch.randn(1, IMAGE_TOKENS + 1, HIDDEN, dtype=torch.bfloat16)
        times = []
        with torch.inference_mode():
            for _ in range(7):
                t0 = time.perf_counter()
                layer(x, None)
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    per_layer = statistics.median(times[2:]) * 1e3
    return max(1, min(MAX_LAYERS, round(target_ms / per_layer))), per_layer


TEMPLATE = (
    "{%- for message in messages -%}{%- if message['content'] is string -%}USER: "
    "{{ message['content'] }}{%- else -%}USER:{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' %} {{ part['text'] }}{%- else %} <image>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor %} ASSISTANT:"
)
REQUEST_TIMEOUT = 120.0


@dataclass(frozen=True)
class Engine:
    """One ``vllm serve`` process on a loopback port."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def engine_env() -> dict[str, str]:
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_SERVER_DEV_MODE="1",  # /collective_rpc: the tower counter of `serve_worker`
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        OMP_NUM_THREADS="1",
        MC_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def start_engine(workdir: Path, name: str, model: Path, ec: dict[str, Any] | None) -> Engine:
    """``vllm serve`` (its API server module: the CPU build's ``vllm`` script looks for the
    ``vllm`` distribution, which is named ``vllm-cpu`` there)."""
    import json

    port = free_port()
    template = workdir / "template.jinja"
    template.write_text(TEMPLATE)
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chat-template",
        str(template),
        "--worker-extension-cls",
        "benchmarks.serve_worker.TowerCounter",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--disable-log-stats",
    ]
    if ec is not None:
        args += ["--ec-transfer-config", json.dumps(ec)]
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=engine_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return Engine(name, port, proc, log)


def stop_engines(engines: Sequence[Engine]) -> None:
    for engine in engines:
        if engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGINT)
    for engine in engines:
        try:
            engine.proc.wait(30)
        except subprocess.TimeoutExpired:
            engine.proc.kill()
            engine.proc.wait()


async def rpc(engine: Engine, method: str) -> list[Any]:
    import json

    out = await loadgen.stream_post("127.0.0.1", engine.port, "/collective_rpc", {"method": method}, 60)
    if not out.ok:
        raise RuntimeError(f"{engine.name}: {method}: {out.error}")
    return [json.loads(r) if isinstance(r, str) else r for r in json.loads(out.body)["results"]]


def wait_healthy(engines: Sequence[Engine], limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.proc.poll() is not None:
                raise SystemExit(f"engine {engine.name} exited:\n{engine.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{engine.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        pending.remove(engine)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise SystemExit(f"engines not healthy in {limit:.0f} s: {[e.name for e in pending]}")
        time.sleep(1.0)


@contextmanager
def engines_running(
    workdir: Path, tag: str, model: Path, ec: dict[str, Any] | None, count: int
) -> Iterator[list[Engine]]:
    engines = [start_engine(workdir, f"{tag}-{i}", model, ec) for i in range(count)]
    try:
        wait_healthy(engines)
        yield engines
    finally:
        stop_engines(engines)


_URLS: dict[int, str] = {}


def image_url(seed: int) -> str:
    """A deterministic random 336 px RGB image as a PNG data URL (built once per seed)."""
    if seed not in _URLS:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(seed)
        picture = Image.fromarray(rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8), "RGB")
        buf = io.BytesIO()
        picture.save(buf, "PNG")
        _URLS[seed] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return _URLS[seed]


def chat_body(model: Path, seed: int, uuid: str | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": image_url(seed)}}
    if uuid is not None:
        part["uuid"] = uuid
    return {
        "model": str(model),
        "stream": True,
        "max_tokens": 2,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "describe the picture"}]}],
    }


@dataclass(frozen=True)
class Cell:
    """One measured run of a trace: a row at one reuse level and one concurrency."""

    row: str
    reuse: float
    clients: int
    outcomes: list[loadgen.Outcome]
    wall: float
    counts: dict[str, float]


def sends_of(
    row: str, engines: Sequence[Engine], model: Path, trace: Sequence[int], base: int, timed: bool
) -> list[Callable[[], Awaitable[loadgen.Outcome]]]:
    """One send per request of ``trace`` (image ``base + id``), alternating over ``engines``;
    with `timed` (one request at a time), each outcome has its own tower time."""
    fresh = row == "none"

    def sender(i: int, image: int) -> Callable[[], Awaitable[loadgen.Outcome]]:
        engine = engines[i % len(engines)]
        body = chat_body(model, base + image, f"r{base}-{i}" if fresh else None)

        async def send() -> loadgen.Outcome:
            post = loadgen.stream_post(
                "127.0.0.1", engine.port, "/v1/chat/completions", body, REQUEST_TIMEOUT
            )
            if not timed:
                return await post
            before = (await rpc(engine, "mmkey_counts"))[0]["tower_s"]
            done = await post
            tower = (await rpc(engine, "mmkey_counts"))[0]["tower_s"] - before
            return dataclasses.replace(done, tower=tower)

        return send

    for image in set(trace):
        image_url(base + image)  # encoded before the clock starts
    return [sender(i, img) for i, img in enumerate(trace)]


async def snapshot(engines: Sequence[Engine]) -> list[dict[str, float]]:
    """Each engine's counters (`serve_worker`)."""
    return [(await rpc(e, "mmkey_counts"))[0] for e in engines]


def taking_turns(rows: Sequence[str]) -> list[str]:
    """The rows (in this order) that take turns at one client: each whose engines (`ROW_ENGINES`)
    no row before it uses."""
    together: list[str] = []
    for row in rows:
        if ROW_ENGINES[row] not in {ROW_ENGINES[r] for r in together}:
            together.append(row)
    return together


async def measure_cells(
    rows: Sequence[str],
    running: dict[str, list[Engine]],
    model: Path,
    trace: Sequence[int],
    base: int,
    reuse: float,
    clients: int,
) -> list[Cell]:
    """Replay ``trace`` for each row (in this order) over its engines (`ROW_ENGINES`), with the
    engines' counter deltas (tower images and seconds, bytes loaded and saved, items loaded).
    At one client the rows take turns request by request (`loadgen.turns`) with every engine
    on one core (`loadgen.servers_on_one_core`); a row whose engines a row before it in the
    turns uses (in-engine after none) runs after them, alone. At more clients, one row after
    another."""
    groups = {row: ROW_ENGINES[row] for row in rows}
    together = taking_turns(rows) if clients == 1 else []
    cells: dict[str, Cell] = {}
    if together:
        pids = list({e.proc.pid for row in together for e in running[groups[row]]})
        before = {row: await snapshot(running[groups[row]]) for row in together}
        sends = [(row, sends_of(row, running[groups[row]], model, trace, base, True)) for row in together]
        with loadgen.servers_on_one_core(pids):
            done = await loadgen.turns(sends)
        await asyncio.sleep(0.5)  # background saves of the last requests land in the counters
        for row in together:
            gained = loadgen.gained(before[row], await snapshot(running[groups[row]]))
            cells[row] = Cell(row, reuse, clients, *done[row], gained)
    for row in (r for r in rows if r not in together):
        engines = running[groups[row]]
        before_row = await snapshot(engines)
        sent = sends_of(row, engines, model, trace, base, clients == 1)
        if clients == 1:
            with loadgen.servers_on_one_core([e.proc.pid for e in engines]):
                outcomes, wall = await loadgen.replay(sent, 1)
        else:
            outcomes, wall = await loadgen.replay(sent, clients)
        await asyncio.sleep(0.5)
        gained = loadgen.gained(before_row, await snapshot(engines))
        cells[row] = Cell(row, reuse, clients, outcomes, wall, gained)
    return [cells[row] for row in rows]


def warm(engines: Sequence[Engine], model: Path) -> None:
    """Two requests per engine of images no trace uses (the first request pays for set-up)."""

    async def go() -> None:
        for engine in engines:
            await rpc(engine, "mmkey_counts")  # installs the counters
            for k in range(2):
                body = chat_body(model, 10_000_000 + 100 * engine.port + k, None)
                out = await loadgen.stream_post("127.0.0.1", engine.port, "/v1/chat/completions", body, 300)
                if not out.ok:
                    raise SystemExit(
                        f"{engine.name}: warm-up failed: {out.error}\n{engine.log.read_text()[-3000:]}"
                    )

    asyncio.run(go())


def mmkey_ec(master: str) -> dict[str, Any]:
    return {
        "ec_connector": "MMKeyECConnector",
        "ec_connector_module_path": "mmkey.integrations.vllm",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {
            "mooncake": {
                "master_server_address": master,
                "global_segment_size": 0,
                "local_buffer_size": "128MB",
            }
        },
    }


def hit_path(master: str, entry: tuple[int, int], repeats: int = 30) -> dict[str, float]:
    """Median ms of a lookup (``batch_is_exist``) and of a verified fetch (``get_embeddings``)
    of one entry of the tower's output shape, through a pure client of the holder."""
    import torch

    from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash

    config = MooncakeConfig(master_server_address=master, global_segment_size=0, local_buffer_size=64 << 20)
    cache = MooncakeCache(config, keyring=None)
    try:
        keys = [
            EmbeddingKey("bench-serve", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i)) for i in range(repeats)
        ]
        tensors = [torch.randn(entry, dtype=torch.float32).to(torch.bfloat16) for _ in keys]
        assert all(cache.insert_batch(keys, tensors))
        look, fetch = [], []
        for key, tensor in zip(keys, tensors, strict=True):
            t0 = time.perf_counter()
            found = cache.batch_is_exist([key])
            t1 = time.perf_counter()
            [got] = cache.get_embeddings([key])
            t2 = time.perf_counter()
            assert found == [True] and got is not None and torch.equal(got, tensor)
            look.append(t1 - t0)
            fetch.append(t2 - t1)
        return {"lookup": statistics.median(look) * 1e3, "fetch": statistics.median(fetch) * 1e3}
    finally:
        cache.close()


ROW_ENGINES = {"none": "plain", "in-engine": "plain", "vllm-store": "store", "mmkey": "mmkey"}
"""The engines each row runs on (none and in-engine share the engines without a connector)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="24 requests a cell, 1 and 16 clients, 80%% reuse")
    p.add_argument("--requests", type=int, default=96, help="requests per cell (default 96)")
    p.add_argument("--clients", default="1,4,16", help="concurrencies (default 1,4,16)")
    p.add_argument("--reuse", default="0.5,0.8", help="shares of repeated images (default 0.5,0.8)")
    p.add_argument("--rows", default="none,in-engine,vllm-store,mmkey", help="rows to run")
    p.add_argument("--engines", type=int, default=2, help="engines per row, sharing the store (default 2)")
    p.add_argument("--no-fault", action="store_true", help="skip the paused-store run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tower-layers",
        type=int,
        default=None,
        help="the tower's layers (default: calibrated to ~200 ms an image)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.reuse = 24, "1,16", "0.8"
    unknown = set(args.rows.split(",")) - set(ROW_ENGINES)
    if unknown:
        p.error(f"unknown rows: {', '.join(sorted(unknown))} (known: {', '.join(ROW_ENGINES)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    reuses = [float(r) for r in args.reuse.split(",")]
    rows = args.rows.split(",")
    from mmkey.testing.fleet import running_fleet
    from tests.integrations.vllm.vllm_engine_model import build_tiny_llava

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="mmkey-bench-serve-"))
    layers, layer_ms = calibrated_layers() if args.tower_layers is None else (args.tower_layers, 0.0)
    model = build_tiny_llava(
        workdir / "model",
        image_size=IMAGE,
        patch=PATCH,
        tower_hidden=HIDDEN,
        tower_layers=layers,
        tower_heads=HEADS,
        tower_intermediate=MLP,
        max_positions=2048,
    )
    plan = [(reuse, c) for reuse in reuses for c in clients]
    traces = {
        (reuse, c): loadgen.make_trace(args.requests, reuse, args.seed + k)
        for k, (reuse, c) in enumerate(plan)
    }
    bases = {cell: 1000 * (k + 1) for k, cell in enumerate(plan)}
    cells: list[Cell] = []
    loads: list[float] = []

    fault: Cell | None = None
    hit: dict[str, float] = {}
    with ExitStack() as stack:
        running: dict[str, list[Engine]] = {}
        if "none" in rows or "in-engine" in rows:
            running["plain"] = stack.enter_context(
                engines_running(workdir, "plain", model, None, args.engines)
            )
        if "vllm-store" in rows:
            storage = workdir / "ec-store"
            storage.mkdir()
            ec = {
                "ec_connector": "ECExampleConnector",
                "ec_role": "ec_both",
                "ec_connector_extra_config": {"shared_storage_path": str(storage)},
            }
            running["store"] = stack.enter_context(engines_running(workdir, "store", model, ec, args.engines))
        if "mmkey" in rows or not args.no_fault:
            fleet = stack.enter_context(running_fleet(holders=1, segment_size=512 << 20))
            ours = mmkey_ec(fleet.master.address)
            running["mmkey"] = stack.enter_context(
                engines_running(workdir, "mmkey", model, ours, args.engines)
            )
        for engines in running.values():
            warm(engines, model)
        for cell, order in loadgen.by_cell(loadgen.interleaved(rows, plan)):
            cells += asyncio.run(measure_cells(order, running, model, traces[cell], bases[cell], *cell))
            loads.append(os.getloadavg()[0])
        if "mmkey" in running:
            hit = hit_path(fleet.master.address, (IMAGE_TOKENS, 128))
            if not args.no_fault:
                reuse, c = max(reuses), max(clients)
                trace = loadgen.make_trace(args.requests, reuse, args.seed + 99)
                fleet.holders[0].pause()
                try:
                    paused = asyncio.run(measure_cells(["mmkey"], running, model, trace, 900_000, reuse, c))
                    fault = dataclasses.replace(paused[0], row="mmkey, store paused")
                finally:
                    fleet.holders[0].resume()
    cells.sort(key=lambda c: (rows.index(c.row), c.clients))  # the tables' order: by row
    report = serve_tables.Report(
        cells=[
            serve_tables.summarize(c.row, c.reuse, c.clients, c.outcomes, c.wall, c.counts) for c in cells
        ],
        fault=None
        if fault is None
        else serve_tables.summarize(
            fault.row, fault.reuse, fault.clients, fault.outcomes, fault.wall, fault.counts
        ),
        hit_ms=hit,
        timeout_s=0.5 + 0.5,
        load=max(loads) if loads else os.getloadavg()[0],
        minutes=(time.monotonic() - started) / 60,
        engines=args.engines,
        requests=args.requests,
    )
    print(
        serve_tables.render(
            report,
            IMAGE_TOKENS,
            f"CLIP {IMAGE} px / {PATCH} px patches, hidden {HIDDEN} x {layers} layers"
            + (f" (calibrated: {layer_ms:.1f} ms a layer here)" if layer_ms else ""),
        )
    )
    shutil.rmtree(workdir, ignore_errors=True)  # kept, with every engine's log, when a run fails
    return 0


if __name__ == "__main__":
    sys.exit(main())
