"""One serving process of the single-flight tests: encodes a burst of images through
`encode_with_cache` on a `MooncakeCache` (a pure client of a fleet), at a moment the test sets.

Run as ``python single_flight_worker.py SPEC_JSON``, or `run` in a process forked from a
server that imported this module (the tests: torch is imported once, not once per worker).
The spec names the master, the images (`images` of them, the same in every worker), the
seconds the encoder sleeps per image, the claim bound, a folder where the worker says it is
ready (``ready-<name>``) and waits for ``go``, and a file where the encoder appends one line
per image it encodes (before sleeping), so that a test can count encodes across processes and
kill a worker mid-encode. Answers (one JSON line, or on the queue) whether every embedding
equals the no-cache output, the report and the stats.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

DIM = 32


def images(count: int) -> list[torch.Tensor]:
    """The burst: `count` distinct images (as feature rows), the same in every process."""
    return [torch.full((4, DIM), float(i)) + torch.arange(DIM) / DIM for i in range(count)]


def reference(feature: torch.Tensor) -> torch.Tensor:
    """What the encoder makes of one image, without any cache."""
    return (feature * 2.0 + 1.0).sum(dim=0)


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from mmkey import MooncakeCache
    from mmkey.cache.mooncake import MooncakeConfig
    from mmkey.encoder import encode_with_cache_report

    config = MooncakeConfig(
        master_server_address=spec["master"],
        local_hostname=spec["host"],
        global_segment_size=0,
        local_buffer_size=4 << 20,
        timeout=spec.get("timeout", 5.0),
        claim_wait=spec["claim_wait"],
    )
    burst = images(spec["images"])
    log = Path(spec["encodes"])
    sleep_s = spec["encode_s"]

    def encode(features: list[torch.Tensor], _grid: object) -> list[torch.Tensor]:
        with log.open("a") as f:
            for feature in features:
                f.write(f"{spec['name']} {int(feature[0, 0].item())}\n")
        # a real encoder's time, in a process of its own, while others wait on this claim
        # (allowed in tests/project/test_no_sleeps.py)
        time.sleep(sleep_s * len(features))
        return [reference(feature) for feature in features]

    with MooncakeCache(config, keyring=None) as cache:
        folder = Path(spec["sync"])
        (folder / f"ready-{spec['name']}").touch()
        while not (folder / "go").exists():
            time.sleep(0.002)
        started = time.monotonic()
        result = encode_with_cache_report(burst, encode=encode, cache=cache, namespace=spec["namespace"])
        took = time.monotonic() - started
        stats = cache.stats()
    equal = all(torch.equal(got, reference(f)) for got, f in zip(result.embeddings, burst, strict=True))
    report = result.report
    return {
        "name": spec["name"],
        "equal": equal,
        "took": took,
        "encoded": report.encoded,
        "coalesced": report.coalesced,
        "hits": report.hits,
        "claims_won": stats.claims_won,
        "waits_served": stats.waits_served,
        "waits_timed_out": stats.waits_timed_out,
    }


def run(spec: dict[str, Any], results: Any) -> None:
    """`main`, its answer put on the `results` queue."""
    results.put(main(spec))


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
