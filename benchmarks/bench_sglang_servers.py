"""SGLang's real encode servers on SGLang's own Mooncake backend and on mmkey's, side by side.

Run in SGLang's environment (``make bench-sglang``). One master and one segment holder; two
encode servers (``--encoder-only --enable-mm-global-cache``, the tiny Qwen2-VL of
``scripts/sglang_e2e.py``, on CPU) with SGLang's own backend (``emb_<hash>`` keys, raw bytes)
and two with mmkey's (``MMKEY_SGLANG_BACKEND=1``, signed entries); the two key spaces are
disjoint. For every image: ``/encode`` on the pair's first server (a
miss: the tower runs, the embedding is put), then on its second (a hit: fetched from the
store). Reports ``/encode`` latency on a miss and on a hit (median, p90, through HTTP and the
ZMQ receiver standing in for the prefill side), the bytes each backend stores per entry, and
what each does with a damaged entry: whether the bytes served equal the tower's.
Absolute times are this machine's; the ratios are the comparison.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
e2e: Any = importlib.import_module("sglang_e2e")

IMAGES = 24
"""Distinct images per backend (seeds from 100 on: none of them seen before)."""


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(run: Any, first: Any, second: Any, namespace_prefix: str, offset: int) -> dict[str, Any]:
    """Each image on ``first`` (a miss), then on ``second`` (a hit); the keys it stored."""
    misses, hits, wrong, keys_before = [], [], 0, set(run.keys())
    for i in range(IMAGES):
        path = run.images(offset + i)
        miss = e2e.encode(first, f"{namespace_prefix}-miss-{i}", [path])
        give_up = time.monotonic() + e2e.STORED_TIMEOUT  # SGLang puts after the request returned
        while len(set(run.keys()) - keys_before) <= i and time.monotonic() < give_up:
            time.sleep(0.05)
        hit = e2e.encode(second, f"{namespace_prefix}-hit-{i}", [path])
        if miss.error or hit.error:
            raise RuntimeError(f"{namespace_prefix}: {miss.error or hit.error}")
        wrong += hit.payload != miss.payload
        misses.append(miss.seconds)
        hits.append(hit.seconds)
    stored = sorted(set(run.keys()) - keys_before)
    return {"misses": misses, "hits": hits, "wrong": wrong, "keys": stored}


def damaged(run: Any, first: Any, second: Any, tag: str, seed: int) -> str:
    """Store an image through ``first``, flip one byte of its stored value, ask ``second``."""
    before = set(run.keys())
    honest = e2e.encode(first, f"{tag}-damaged-a", [run.images(seed)])
    give_up = time.monotonic() + e2e.STORED_TIMEOUT
    while not (set(run.keys()) - before) and time.monotonic() < give_up:
        time.sleep(0.05)
    [key] = sorted(set(run.keys()) - before)
    with run.raw_client() as client:
        data = bytearray(client.get(key))
        data[-3] ^= 0x01
        e2e._replace(client, key, bytes(data))
    served = e2e.encode(second, f"{tag}-damaged-b", [run.images(seed)])
    if served.error:
        return f"error: {served.error[:80]}"
    return "served the tower's bytes" if served.payload == honest.payload else "SERVED WRONG BYTES"


def main() -> int:
    from mmkey.testing.fleet import running_fleet

    kernel = e2e.sgl_kernel_kind()
    extra = ("--device", "cpu", *(() if kernel.startswith("real") else e2e.KERNEL_FREE_ARGS))
    servers: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="mmkey-bench-sglang-") as tmp,
        running_fleet(holders=1, segment_size=256 << 20) as fleet,
    ):
        root = Path(tmp)
        try:
            stand_in, model = e2e.prepare(root, kernel)
            env = e2e.server_env(root, fleet.master.address, "cpu", stand_in)
            theirs = {k: v for k, v in env.items() if not k.startswith("MMKEY_")}
            ours = dict(env, MMKEY_NAMESPACE=e2e.NAMESPACE)
            for name, server_env in (("s1", theirs), ("s2", theirs), ("m1", ours), ("m2", ours)):
                servers[name] = e2e.start_server(name, model, server_env, root, extra, global_cache=True)
            e2e.wait_healthy(list(servers.values()))
            run = e2e.Run(root, fleet, servers, lambda seed: e2e.image(root, seed))
            results = {
                "sglang": measure(run, servers["s1"], servers["s2"], "sglang", 100),
                "mmkey": measure(run, servers["m1"], servers["m2"], "mmkey", 100 + IMAGES),
            }
            with run.raw_client() as client:
                sizes = {name: client.get_size(r["keys"][0]) for name, r in results.items()}
            fates = {
                "sglang": damaged(run, servers["s1"], servers["s2"], "sglang", 90),
                "mmkey": damaged(run, servers["m1"], servers["m2"], "mmkey", 91),
            }
        finally:
            for server in servers.values():
                server.stop()
    print(
        f"benchmarks/bench_sglang_servers.py: 4 SGLang 0.5.23 encode servers on CPU (tiny Qwen2-VL, "
        f"{IMAGES} images of 112x112 per backend), one master and one holder on loopback, "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(f"{'/encode, ms (ratio mmkey/sglang)':38} {'sglang':>9} {'mmkey':>9} {'ratio':>7}")
    for label, field in (("miss", "misses"), ("hit", "hits")):
        for stat, fn in (("median", statistics.median), ("p90", lambda v: quantile(v, 0.9))):
            s, m = fn(results["sglang"][field]) * 1e3, fn(results["mmkey"][field]) * 1e3
            print(f"{label + ' (' + stat + ')':38} {s:9.1f} {m:9.1f} {m / s:6.2f}x")
    print(f"{'bytes stored per entry':38} {sizes['sglang']:9d} {sizes['mmkey']:9d}")
    wrong = {name: r["wrong"] for name, r in results.items()}
    print(f"{'hits whose bytes differ from the miss':38} {wrong['sglang']:9d} {wrong['mmkey']:9d}")
    print(f"a damaged entry: sglang {fates['sglang']}; mmkey {fates['mmkey']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
