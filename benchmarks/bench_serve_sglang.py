"""What a user gains, served as SGLang serves: two encode servers behind their ``/encode`` API.

Run in SGLang's environment (``make bench-serve-sglang``, or ``python
benchmarks/bench_serve_sglang.py [--quick]`` there). The SGLang half of `bench_serve`: it
builds a random-weight Qwen2-VL (`sglang_e2e.build_model`) whose vision tower costs what a
real one does (336 px images in 14 px patches, 576 patches merged into 144 tokens, width 384 x
12 layers: 100-200 ms an image on one core of this CPU), nothing downloaded. Every row runs
two encoder-only SGLang servers on CPU (`sglang_e2e.start_server`; the fleet: requests
alternate between them) and replays a seeded trace with Zipf-like image reuse (`loadgen`) at
1, 4 and 16 concurrent clients. A request is one ``/encode`` of one image and the wait for its
embedding at a ZMQ receiver standing in for the prefill side (`sglang_e2e.encode`): its
latency is the stand-in for time to first token (the prefill starts once the embedding is
there). Rows:

- none: no global cache (``--enable-mm-global-cache`` off): every image runs the tower;
- sglang: SGLang's own Mooncake backend (``emb_<hash>`` keys, raw bytes) on a local master
  and one holder;
- mmkey: mmkey's backend (``MMKEY_SGLANG_BACKEND=1``, signed entries) on the same master.

Each server encodes one request's image at a time (``SGLANG_ENCODER_MAX_BATCH_SIZE=1``,
``--max-batch``): SGLang's CPU vision attention (``sdpa``) masks a fused batch as one sequence,
so a batch of n images costs about n squared images' time (SGLang's default of 8 halved the
none row's requests/s from 1 to 16 clients), where a GPU's variable-length kernels cost n.

Every row's servers run at once, and each cell runs all rows back to back, the first row
turning from cell to cell (`loadgen.interleaved`): a shared host's speed drifts over minutes,
and rows run minutes apart compared that drift, not the caches. At one client, where p99 is
close to the slowest request, the rows take turns request by request (`loadgen.turns`) and
every server runs on one core, the rest of the benchmark on the other
(`loadgen.servers_on_one_core`): the speed of this host's cores drifts within seconds and
differs between them, and a row whose servers the scheduler kept on the slower core ran its
tower 20% slower. Then mmkey with its holder paused (SIGSTOP: a store that stops answering).
Tower runs and tower time, and the bytes the store moved, come from counters in each server
(`sglang_serve_worker`); the hit path (lookup, then a verified fetch into pool pages, through
`MMKeyEmbeddingStore` as SGLang calls it) is timed in this process on the same store with an
entry of the tower's output size. Absolute times are this CPU's; ratios are the claim."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
import serve_tables  # noqa: E402

e2e: Any = importlib.import_module("sglang_e2e")

IMAGE, PATCH, MERGE = 336, 14, 2
VISION = {"depth": 12, "embed_dim": 384, "num_heads": 6, "mlp_ratio": 4}
HIDDEN = 512
"""The decoder's width: each image token's embedding is this many bf16 values."""
IMAGE_TOKENS = (IMAGE // PATCH // MERGE) ** 2
STORE_TIMEOUT = 0.5
"""Seconds one store call may take in mmkey's backend (``MOONCAKE_TIMEOUT``; mmkey's default)."""
NAMESPACE = "bench-serve-sglang"
LAUNCHER = (str(HERE / "sglang_serve_worker.py"),)
ROWS = ("none", "sglang", "mmkey")
HIT_LABELS = {
    "lookup": "lookup (batch_is_exist)",
    "fetch": "fetch + verify into pool pages (batch_get_into_multi_buffers)",
    "tower": "tower, per image (in the servers)",
}


def counts(server: Any) -> dict[str, float]:
    """The server's counters (`sglang_serve_worker`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/mmkey_counts", timeout=60) as reply:
        found: dict[str, float] = json.loads(reply.read())
        return found


@contextmanager
def servers_running(
    root: Path,
    tag: str,
    model: Path,
    env: dict[str, str],
    extra: Sequence[str],
    global_cache: bool,
    count: int,
    keep: Path | None = None,
) -> Iterator[list[Any]]:
    """``count`` encode servers of one configuration, healthy, stopped on exit (their logs
    copied into ``keep``)."""
    servers = [
        e2e.start_server(f"{tag}-{i}", model, env, root, extra, global_cache, launcher=LAUNCHER)
        for i in range(count)
    ]
    try:
        e2e.wait_healthy(servers)
        yield servers
    finally:
        for server in servers:
            server.stop()
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(server.log, keep / server.log.name)


@dataclass(frozen=True)
class Cell:
    """One measured run of a trace: a row at one reuse level and one concurrency."""

    row: str
    reuse: float
    clients: int
    outcomes: list[loadgen.Outcome]
    wall: float
    counts: dict[str, float]


class Images:
    """The benchmark's pictures: ``IMAGE`` px, one file per seed, made before any clock starts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[int, str] = {}

    def __call__(self, seed: int) -> str:
        """The picture of ``seed``: random pixels from a generator seeded with it (distinct for
        every seed; `sglang_e2e.image`'s patterns repeat every 256 seeds)."""
        if seed not in self._paths:
            import numpy as np
            from PIL import Image

            rng = np.random.default_rng(seed)
            path = self.root / f"bench-image-{seed}.png"
            Image.fromarray(rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8), "RGB").save(path)
            self._paths[seed] = str(path)
        return self._paths[seed]


def encode_outcome(server: Any, req_id: str, path: str, timed: bool = False) -> loadgen.Outcome:
    """One ``/encode`` and the wait for its embedding, as the load generator's outcome; with
    `timed` (one request at a time), the seconds the server's tower ran for it too."""
    before = counts(server)["tower_s"] if timed else 0.0
    done = e2e.encode(server, req_id, [path])
    tower = counts(server)["tower_s"] - before if timed else None
    return loadgen.Outcome(done.seconds, done.seconds, done.status, done.error, tower=tower)


def sends_of(
    row: str,
    servers: Sequence[Any],
    images: Images,
    trace: Sequence[int],
    base: int,
    timed: bool,
    pool: ThreadPoolExecutor,
) -> list[Callable[[], Awaitable[loadgen.Outcome]]]:
    """One send per request of ``trace`` (image ``base + id``), alternating over ``servers``;
    with `timed` (one request at a time), each outcome has its own tower time."""
    loop = asyncio.get_running_loop()

    def sender(i: int, image: int) -> Callable[[], Awaitable[loadgen.Outcome]]:
        server = servers[i % len(servers)]
        path = images(base + image)
        req_id = f"{row}-{base}-{i}"
        return lambda: loop.run_in_executor(pool, encode_outcome, server, req_id, path, timed)

    return [sender(i, image) for i, image in enumerate(trace)]  # every picture made first


async def measure_cells(
    rows: Sequence[str],
    running: dict[str, list[Any]],
    images: Images,
    trace: Sequence[int],
    base: int,
    reuse: float,
    clients: int,
    pool: ThreadPoolExecutor,
) -> list[Cell]:
    """Replay ``trace`` for each row (in this order) over its servers; with the servers' counter
    deltas (tower images and seconds, entries and bytes the store moved). At one client the
    rows take turns request by request (`loadgen.turns`) with every server on one core
    (`loadgen.servers_on_one_core`); at more, one row after another."""
    before = {row: [counts(s) for s in running[row]] for row in rows}
    sends = {row: sends_of(row, running[row], images, trace, base, clients == 1, pool) for row in rows}
    if clients == 1:
        pids = [server.process.pid for row in rows for server in running[row]]
        with loadgen.servers_on_one_core(pids):
            done = await loadgen.turns([(row, sends[row]) for row in rows])
    else:
        done = {row: await loadgen.replay(sends[row], clients) for row in rows}
    await asyncio.sleep(0.5)  # background puts of the last requests land in the counters
    after = {row: [counts(s) for s in running[row]] for row in rows}
    return [Cell(row, reuse, clients, *done[row], loadgen.gained(before[row], after[row])) for row in rows]


def warm(servers: Sequence[Any], images: Images) -> None:
    """Two requests per server of images no trace uses (the first request pays for set-up)."""
    for n, server in enumerate(servers):
        for k in range(2):
            done = e2e.encode(server, f"warm-{server.name}-{k}", [images(50_000_000 + 10 * n + k)])
            if done.error:
                raise SystemExit(f"{server.name}: warm-up failed: {done.error}\n{server.text()[-3000:]}")


def hit_path(master: str, root: Path, repeats: int = 30) -> dict[str, float]:
    """Median ms of a lookup (``batch_is_exist``) and of a verified fetch into pool pages
    (``batch_get_into_multi_buffers``) of one image's embedding through `MMKeyEmbeddingStore`,
    a pure client of the holder, as an encode server calls it (signed entries, as the servers
    store them). Each entry is written through the store's cache, not the store: the store
    would answer a lookup of what it wrote itself from memory for a second."""
    import torch

    from mmkey import Modality, MooncakeConfig
    from mmkey.integrations.sglang import MMKeyEmbeddingStore

    os.environ.update(MMKEY_ENTRY_AUTH="required", MMKEY_ENTRY_KEY_FILE=str(root / "entry.key"))
    os.environ.pop("MMKEY_ENTRY_KEY", None)
    config = MooncakeConfig(
        master_server_address=master, global_segment_size=0, local_buffer_size=64 << 20, timeout=STORE_TIMEOUT
    )
    store = MMKeyEmbeddingStore(namespace=NAMESPACE + "-hit-path", config=config, tp_rank=0)
    try:
        pool = torch.zeros((4 * IMAGE_TOKENS, HIDDEN), dtype=torch.bfloat16)
        store.register_buffer(pool)
        size = IMAGE_TOKENS * HIDDEN * pool.element_size()
        texts = [str(10**17 + i) for i in range(repeats)]
        tensors = [torch.randn((IMAGE_TOKENS, HIDDEN)).to(torch.bfloat16) for _ in texts]
        keys = [store.key_for(text, Modality.IMAGE) for text in texts]
        if not all(store.cache.insert_batch(keys, tensors)):
            raise SystemExit("hit path: the entries were not stored")
        look, fetch = [], []
        for i, (text, tensor) in enumerate(zip(texts, tensors, strict=True)):
            rows = pool[(i % 4) * IMAGE_TOKENS : (i % 4 + 1) * IMAGE_TOKENS]
            t0 = time.perf_counter()
            found = store.batch_is_exist([text])
            t1 = time.perf_counter()
            landed = store.batch_get_into_multi_buffers([text], [[rows.data_ptr()]], [[size]])
            t2 = time.perf_counter()
            if found != [True] or landed != [True] or not torch.equal(rows, tensor):
                raise SystemExit(f"hit path: entry {i} not served ({found}, {landed})")
            look.append(t1 - t0)
            fetch.append(t2 - t1)
        return {"lookup": statistics.median(look) * 1e3, "fetch": statistics.median(fetch) * 1e3}
    finally:
        store.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 requests a cell, 1 and 16 clients, 80%% reuse")
    p.add_argument("--requests", type=int, default=96, help="requests per cell (default 96)")
    p.add_argument("--clients", default="1,4,16", help="concurrencies (default 1,4,16)")
    p.add_argument("--reuse", default="0.5,0.8", help="shares of repeated images (default 0.5,0.8)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to run (default {','.join(ROWS)})")
    p.add_argument("--servers", type=int, default=2, help="servers per row, sharing the store (default 2)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="images SGLang fuses into one tower run (SGLANG_ENCODER_MAX_BATCH_SIZE; default 1: on "
        "CPU its attention masks a fused batch as one sequence, so n images cost n squared)",
    )
    p.add_argument("--no-fault", action="store_true", help="skip the paused-store run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="copy every server's log into this folder")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.reuse = 16, "1,16", "0.8"
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        p.error(f"unknown rows: {', '.join(sorted(unknown))} (known: {', '.join(ROWS)})")
    return args


def report_of(
    cells: Sequence[Cell],
    fault: Cell | None,
    hit: dict[str, float],
    load: float,
    minutes: float,
    args: Any,
    started: str = "",
) -> serve_tables.Report:
    """The printout's content (`serve_tables`) from the measured cells."""

    def summary(c: Cell) -> serve_tables.Summary:
        return serve_tables.summarize(c.row, c.reuse, c.clients, c.outcomes, c.wall, c.counts)

    notes = [
        "",
        "/encode ms: from the request to its embedding at the receiver (the prefill side's "
        "stand-in): the time-to-first-token stand-in of an encoder-disaggregated deployment.",
    ]
    for label, group in (
        ("mmkey rows", [c for c in cells if c.row == "mmkey"]),
        ("store paused", [fault] if fault is not None else []),
    ):
        if group:
            served, out = (sum(c.counts.get(k, 0.0) for c in group) for k in ("coalesced", "waits_timed_out"))
            notes.append(
                f"single-flight, {label}: {served:.0f} lookups waited for an entry another server was "
                f"encoding and were served it; {out:.0f} waited the whole claim wait and encoded"
            )

    return serve_tables.Report(
        cells=[summary(c) for c in cells],
        fault=None if fault is None else summary(fault),
        hit_ms=hit,
        timeout_s=STORE_TIMEOUT,
        load=load,
        minutes=minutes,
        engines=args.servers,
        requests=args.requests,
        script="benchmarks/bench_serve_sglang.py",
        servers="SGLang 0.5.23 encode servers on CPU (`--encoder-only`, `/encode` to a ZMQ receiver)",
        latency="/encode",
        hit_labels=dict(HIT_LABELS),
        started=started,
        notes=notes,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    reuses = [float(r) for r in args.reuse.split(",")]
    rows = args.rows.split(",")
    from mmkey.testing.fleet import running_fleet

    started = time.monotonic()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    root = Path(tempfile.mkdtemp(prefix="mmkey-bench-serve-sglang-"))
    kernel = e2e.sgl_kernel_kind()
    extra = ("--device", "cpu", *(() if kernel.startswith("real") else e2e.KERNEL_FREE_ARGS))
    stand_in, model = e2e.prepare(
        root, kernel, vision=VISION, hidden=HIDDEN, max_pixels=IMAGE * IMAGE, name="qwen2-vl-bench"
    )
    images = Images(root)
    plan = [(reuse, c) for reuse in reuses for c in clients]
    traces = {cell: loadgen.make_trace(args.requests, cell[0], args.seed + k) for k, cell in enumerate(plan)}
    bases = {cell: 1000 * (k + 1) for k, cell in enumerate(plan)}
    fault_trace = loadgen.make_trace(args.requests, max(reuses), args.seed + 99)
    for cell in plan:
        for image in set(traces[cell]):
            images(bases[cell] + image)
    for image in set(fault_trace):
        images(900_000 + image)
    cells: list[Cell] = []
    loads: list[float] = []
    fault: Cell | None = None
    hit: dict[str, float] = {}
    pool = ThreadPoolExecutor(max_workers=max(clients))

    try:
        with running_fleet(holders=1, segment_size=512 << 20) as fleet, ExitStack() as stack:
            env = e2e.server_env(root, fleet.master.address, "cpu", stand_in)
            env["MOONCAKE_TIMEOUT"] = str(STORE_TIMEOUT)
            env["SGLANG_ENCODER_MAX_BATCH_SIZE"] = str(args.max_batch)
            plain = {k: v for k, v in env.items() if not k.startswith("MMKEY_")}
            configs = {
                "none": (plain, False),  # no global cache
                "sglang": (plain, True),  # SGLang's own Mooncake backend
                "mmkey": (dict(env, MMKEY_NAMESPACE=NAMESPACE), True),
            }
            needed = [*rows, *(["mmkey"] if not args.no_fault and "mmkey" not in rows else [])]
            running: dict[str, list[Any]] = {}
            for name in needed:
                server_env, global_cache = configs[name]
                started_servers = servers_running(
                    root, name, model, server_env, extra, global_cache, args.servers, args.keep
                )
                running[name] = stack.enter_context(started_servers)
            for servers in running.values():
                warm(servers, images)
            for cell, order in loadgen.by_cell(loadgen.interleaved(rows, plan)):
                cells += asyncio.run(
                    measure_cells(order, running, images, traces[cell], bases[cell], *cell, pool)
                )
                loads.append(os.getloadavg()[0])
            if "mmkey" in running:
                hit = hit_path(fleet.master.address, root)
                if not args.no_fault:
                    fleet.holders[0].pause()
                    try:
                        (paused,) = asyncio.run(
                            measure_cells(
                                ["mmkey"],
                                running,
                                images,
                                fault_trace,
                                900_000,
                                max(reuses),
                                max(clients),
                                pool,
                            )
                        )
                        fault = replace(paused, row="mmkey, store paused")
                        loads.append(os.getloadavg()[0])
                    finally:
                        fleet.holders[0].resume()
    finally:
        pool.shutdown()
    cells.sort(key=lambda c: (rows.index(c.row), c.clients))  # the tables' order: by row
    report = report_of(
        cells,
        fault,
        hit,
        max(loads) if loads else os.getloadavg()[0],
        (time.monotonic() - started) / 60,
        args,
        began,
    )
    tower = (
        f"Qwen2-VL {IMAGE} px / {PATCH} px patches, width {VISION['embed_dim']} x {VISION['depth']} layers, "
        f"embeddings {HIDDEN} wide"
    )
    print(serve_tables.render(report, IMAGE_TOKENS, tower))
    shutil.rmtree(root, ignore_errors=True)  # kept, with every server's log, when a run fails
    return 0


if __name__ == "__main__":
    sys.exit(main())
