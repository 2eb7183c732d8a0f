"""Single-flight: a burst of the same images sent to 4 workers at once, claims off and on.

Run: ``python benchmarks/bench_single_flight.py``. Starts a fleet (`mmkey.testing.fleet`: a
master and one holder process on 127.0.0.1) and, per mode, 4 worker processes, each a pure
client (`MooncakeCache`) running `encode_with_cache` with an encoder that sleeps
`ENCODE_S` per image (a vision tower's time, without its CPU). Each round, every worker gets
the same `IMAGES` new images in one request at the same moment (a file barrier). Printed per
mode: images encoded in total (a perfect single-flight encodes each image once: `IMAGES`
per round), the time to the embeddings of each request (p50, p99, max), and the waits.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

WORKERS = 4
IMAGES = 8
ROUNDS = 6
ENCODE_S = 0.1
CLAIM_WAIT = 2.0


def _worker(spec: dict[str, Any]) -> None:
    """One serving process: a request per round, its duration and counts as JSON lines."""
    import torch

    from mmkey import MooncakeCache
    from mmkey.cache.mooncake import MooncakeConfig
    from mmkey.encoder import encode_with_cache_report

    config = MooncakeConfig(
        master_server_address=spec["master"],
        local_hostname=spec["host"],
        global_segment_size=0,
        local_buffer_size=8 << 20,
        timeout=2.0,
        claim_wait=spec["claim_wait"],
    )
    folder = Path(spec["sync"])
    calls = 0

    def encode(features: list[torch.Tensor], _grid: object) -> list[torch.Tensor]:
        nonlocal calls
        calls += 1
        time.sleep(ENCODE_S * len(features))
        return [f.mean(dim=0).repeat(64) for f in features]

    with MooncakeCache(config, keyring=None) as cache:
        for round_ in range(spec["rounds"]):
            burst = [torch.full((16, 64), float(i + 1000 * round_)) for i in range(spec["images"])]
            (folder / f"ready-{round_}-{spec['name']}").touch()
            while not (folder / f"go-{round_}").exists():
                time.sleep(0.001)
            start = time.perf_counter()
            result = encode_with_cache_report(burst, encode=encode, cache=cache, namespace=spec["namespace"])
            took = time.perf_counter() - start
            report = result.report
            line = {"took": took, "encoded": report.encoded, "coalesced": report.coalesced, "calls": calls}
            print(json.dumps(line), flush=True)
        stats = cache.stats()
        print(json.dumps({"timed_out": stats.waits_timed_out, "won": stats.claims_won}), flush=True)


def _run_mode(master: str, host: str, claim_wait: float) -> dict[str, Any]:
    folder = Path(f"/tmp/mmkey-bench-flight-{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    namespace = f"bench-flight-{uuid.uuid4().hex[:8]}"
    here = Path(__file__).resolve().parent
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    procs = []
    for i in range(WORKERS):
        spec = {
            "master": master,
            "host": host,
            "name": f"w{i}",
            "namespace": namespace,
            "images": IMAGES,
            "rounds": ROUNDS,
            "claim_wait": claim_wait,
            "sync": str(folder),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(here / "bench_single_flight.py"), "--worker", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        )
    try:
        for round_ in range(ROUNDS):
            deadline = time.monotonic() + 120
            while len(list(folder.glob(f"ready-{round_}-*"))) < WORKERS:
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not get ready")
                time.sleep(0.005)
            time.sleep(0.05)  # every worker is polling for the go file
            (folder / f"go-{round_}").touch()
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    lines = [[json.loads(line) for line in out.split("\n") if line] for out in outputs]
    rounds = [line for worker in lines for line in worker[:-1]]
    totals = [worker[-1] for worker in lines]
    times = sorted(r["took"] for r in rounds)
    return {
        "encoded": sum(r["encoded"] for r in rounds),
        "calls": sum(worker[-2]["calls"] for worker in lines),
        "coalesced": sum(r["coalesced"] for r in rounds),
        "timed_out": sum(t["timed_out"] for t in totals),
        "p50": statistics.median(times),
        "p99": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        "max": times[-1],
        "requests": len(times),
    }


def main() -> None:
    from mmkey.testing.fleet import running_fleet

    print(
        f"single-flight: {WORKERS} workers, each round the same {IMAGES} new images to all at once, "
        f"{ROUNDS} rounds; encoder {ENCODE_S * 1000:.0f} ms per image (sleeping); claim_wait {CLAIM_WAIT} s"
    )
    print(f"ideal: {IMAGES * ROUNDS} images encoded; off encodes {WORKERS * IMAGES * ROUNDS}")
    with running_fleet(holders=1) as fleet:
        results = {
            "off": _run_mode(fleet.master.address, fleet.client_host, 0.0),
            "on": _run_mode(fleet.master.address, fleet.client_host, CLAIM_WAIT),
        }
    print(
        f"{'single-flight':>13} | {'images encoded':>14} | {'encoder calls':>13} | {'coalesced':>9} | "
        f"{'timed out':>9} | {'p50 ms':>7} | {'p99 ms':>7} | {'max ms':>7}"
    )
    for mode, r in results.items():
        print(
            f"{mode:>13} | {r['encoded']:>14} | {r['calls']:>13} | {r['coalesced']:>9} | "
            f"{r['timed_out']:>9} | {r['p50'] * 1000:>7.1f} | {r['p99'] * 1000:>7.1f} | "
            f"{r['max'] * 1000:>7.1f}"
        )
    on, off = results["on"], results["off"]
    print(
        f"time to the embeddings, on / off: p50 {on['p50'] / off['p50']:.2f}x, "
        f"p99 {on['p99'] / off['p99']:.2f}x ({on['requests']} requests per mode)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        main()
