"""Hashing throughput of mmkey against the field's algorithms, side by side in one run.

Run: ``python benchmarks/bench_hash.py [--repeats N]``. Prints GB/s and ratios against
the SGLang CPU algorithm and against memory read bandwidth, then the per-key cost of
``to_key()`` and ``from_key()``. Targets (ISSUE 2): BLAKE3 >= 4x the SGLang CPU
algorithm; XXH3 >= 0.6 of read bandwidth.
"""

from __future__ import annotations

import argparse
import platform

import torch

from mmkey._hashbench import hash_rows, key_roundtrip_ns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per path (best kept)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print("tensor: 9216 x 1176 (Qwen2-VL pixel_values); best of", args.repeats)
    print(f"{'path':40} {'dtype':9} {'GB/s':>7} {'x SGLang':>9} {'x read':>7}")
    for row in hash_rows(repeats=args.repeats):
        print(
            f"{row.path:40} {row.dtype:9} {row.gb_per_s:7.2f} "
            f"{row.vs_sglang_cpu:9.2f} {row.vs_read_bandwidth:7.2f}"
        )
    to_key, from_key = key_roundtrip_ns()
    print(
        f"key to_key(): {to_key:.0f} ns/key, from_key(): {from_key:.0f} ns/key, "
        f"round trip {to_key + from_key:.0f} ns/key"
    )


if __name__ == "__main__":
    main()
