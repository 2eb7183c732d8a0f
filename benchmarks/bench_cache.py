"""Entry codec and MemoryCache speed, side by side with the plain paths, in one run.

Run: ``python benchmarks/bench_cache.py [--repeats N]``. The codec rows compare
`encode_entry` with ``tobytes()`` and verified `verify` with
``torch.frombuffer(...).clone()`` on the same bf16 tensors (target: decode at least 0.8 of
the plain path from 64 KiB to 8 MiB). The authenticated rows put entries signed with a
fleet secret (BLAKE3 keyed MAC) beside unsigned ones, as the time ratio (target: verified
authenticated reads at most 1.5x the unauthenticated ones). The MemoryCache rows give keys
per second for batches of 1, 32 and 1000 keys, without and with a secret. The AsyncCache
rows put `AsyncCache.insert_batch` (CUDA-stream wait and cancellation bookkeeping, no copy)
beside the bare wrapped insert run in the same executor, as the time ratio. The private
verification rows put reads as they verify now (each chunk copied into memory nobody else
can write, then hashed there) beside verifying the entry in place and then copying it out,
as the time ratio. Each path keeps its best of N interleaved rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch

from mmkey import (
    AsyncCache,
    EmbeddingKey,
    EntryKeyring,
    HashScheme,
    MemoryCache,
    Modality,
    mm_hash,
)
from mmkey.entry.codec import encode_entry, verify

ENTRY_SIZES = (64 << 10, 256 << 10, 1 << 20, 8 << 20)
BATCHES = (1, 32, 1000)
ASYNC_BATCHES = ((32, 16 << 10), (8, 1 << 20), (2, 8 << 20))
"""(keys, bytes per bf16 embedding) of the AsyncCache insert rows."""
EMBEDDING = (8, 1024)
"""Shape of each MemoryCache test embedding (bf16, 16 KiB)."""
DECODE_TARGET = 0.8
AUTH_READ_TARGET = 1.5
"""Authenticated reads take at most this many times the unauthenticated ones."""
KEYRING = EntryKeyring.from_secrets(hashlib.sha256(b"benchmark secret").digest())
ROUND_S = 0.02


def best_seconds(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds per call of each path, measured in interleaved rounds of ~20 ms."""
    calls: dict[str, int] = {}
    for name, path in paths.items():
        path()
        start = time.perf_counter()
        path()
        calls[name] = max(1, int(ROUND_S / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, path in paths.items():
            n = calls[name]
            start = time.perf_counter()
            for _ in range(n):
                path()
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return best


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey("qwen2-vl-7b-instruct", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def plain_bytes(t: torch.Tensor) -> bytes:
    """The plain encode: the tensor's bytes, as ``tobytes()`` gives them."""
    return t.view(torch.uint8).numpy().tobytes()


def plain_decode(raw: bytes, shape: torch.Size) -> torch.Tensor:
    """The plain decode: a tensor over the bytes, cloned so it owns its memory."""
    return torch.frombuffer(raw, dtype=torch.bfloat16).view(shape).clone()


def codec_table(repeats: int) -> None:
    print(
        f"\ncodec (bf16 [n, 1024]; GB/s of payload; ratio = codec / plain; decode target >= {DECODE_TARGET})"
    )
    print(
        f"{'entry':>8} | {'tobytes':>8} {'encode':>8} {'ratio':>6} | "
        f"{'frombuf+clone':>13} {'decode':>8} {'ratio':>6} {'target':>6}"
    )
    text = key(1).to_key()
    for size in ENTRY_SIZES:
        t = torch.randn(size // 2048, 1024).to(torch.bfloat16)
        times = best_seconds(
            {
                "tobytes": partial(plain_bytes, t),
                "encode": partial(encode_entry, text, t),
                "plain": partial(plain_decode, plain_bytes(t), t.shape),
                "decode": partial(verify, text, encode_entry(text, t)),
            },
            repeats,
        )
        gbs = {name: size / s / 1e9 for name, s in times.items()}
        enc, dec = times["tobytes"] / times["encode"], times["plain"] / times["decode"]
        print(
            f"{size >> 10:>4} KiB | {gbs['tobytes']:8.2f} {gbs['encode']:8.2f} {enc:6.2f} | "
            f"{gbs['plain']:13.2f} {gbs['decode']:8.2f} {dec:6.2f} "
            f"{'met' if dec >= DECODE_TARGET else 'missed':>6}"
        )


def auth_table(repeats: int) -> None:
    print(
        f"\nauthenticated codec (bf16 [n, 1024]; GB/s of payload; cost = signed time / "
        f"unsigned time; read target <= {AUTH_READ_TARGET})"
    )
    print(
        f"{'entry':>8} | {'encode':>8} {'signed':>8} {'cost':>6} | "
        f"{'decode':>8} {'verified':>8} {'cost':>6} {'target':>6}"
    )
    text = key(1).to_key()
    for size in ENTRY_SIZES:
        t = torch.randn(size // 2048, 1024).to(torch.bfloat16)
        times = best_seconds(
            {
                "encode": partial(encode_entry, text, t),
                "signed": partial(encode_entry, text, t, keyring=KEYRING),
                "decode": partial(verify, text, encode_entry(text, t)),
                "verified": partial(verify, text, encode_entry(text, t, keyring=KEYRING), keyring=KEYRING),
            },
            repeats,
        )
        gbs = {name: size / s / 1e9 for name, s in times.items()}
        enc, dec = times["signed"] / times["encode"], times["verified"] / times["decode"]
        print(
            f"{size >> 10:>4} KiB | {gbs['encode']:8.2f} {gbs['signed']:8.2f} {enc:6.2f} | "
            f"{gbs['decode']:8.2f} {gbs['verified']:8.2f} {dec:6.2f} "
            f"{'met' if dec <= AUTH_READ_TARGET else 'missed':>6}"
        )


def verify_in_place_then_clone(text: str, entry: bytearray, keyring: EntryKeyring | None) -> object:
    """How reads verified before: hash the entry where it lies, then copy it out (a second
    read of memory a stranger can rewrite in between)."""
    return verify(text, entry, copy=False, keyring=keyring)[0].clone()


def verify_in_place_then_copy_into(
    text: str, entry: bytearray, target: torch.Tensor, keyring: EntryKeyring | None
) -> None:
    target.copy_(verify(text, entry, copy=False, keyring=keyring)[0])


def private_table(repeats: int) -> None:
    print(
        "\nprivate verification (bf16 [n, 1024]; GB/s of payload; cost = time of today's "
        "chunked copy-then-hash into private memory / time of hashing in place, then copying)"
    )
    print(
        f"{'entry':>8} {'auth':>5} | {'in place':>8} {'private':>8} {'cost':>6} | "
        f"{'into, in place':>14} {'into':>8} {'cost':>6}"
    )
    text = key(1).to_key()
    for size in ENTRY_SIZES:
        t = torch.randn(size // 2048, 1024).to(torch.bfloat16)
        target = torch.empty_like(t)
        for ring in (None, KEYRING):
            entry = bytearray(encode_entry(text, t, keyring=ring))
            times = best_seconds(
                {
                    "in place": partial(verify_in_place_then_clone, text, entry, ring),
                    "private": partial(verify, text, entry, keyring=ring),
                    "into in place": partial(verify_in_place_then_copy_into, text, entry, target, ring),
                    "into": partial(verify, text, entry, target, keyring=ring),
                },
                repeats,
            )
            gbs = {name: size / s / 1e9 for name, s in times.items()}
            cost = times["private"] / times["in place"]
            cost_into = times["into"] / times["into in place"]
            print(
                f"{size >> 10:>4} KiB {'MAC' if ring else '-':>5} | {gbs['in place']:8.2f} "
                f"{gbs['private']:8.2f} {cost:6.2f} | {gbs['into in place']:14.2f} "
                f"{gbs['into']:8.2f} {cost_into:6.2f}"
            )


def memory_table(repeats: int) -> None:
    print(
        f"\nMemoryCache (bf16 {list(EMBEDDING)} embeddings, 16 KiB each; thousands of keys/s; "
        "signed: with a fleet secret)"
    )
    print(f"{'batch':>6} {'secret':>6} | {'insert_batch':>12} {'batch_is_exist':>14} {'get_embeddings':>14}")
    for batch in BATCHES:
        keys = [key(i) for i in range(batch)]
        tensors = [torch.randn(*EMBEDDING).to(torch.bfloat16) for _ in keys]
        for keyring in (None, KEYRING):
            cache = MemoryCache(1 << 30, keyring=keyring)
            cache.insert_batch(keys, tensors)
            times = best_seconds(
                {
                    "insert": partial(cache.insert_batch, keys, tensors),
                    "exist": partial(cache.batch_is_exist, keys),
                    "get": partial(cache.get_embeddings, keys),
                },
                repeats,
            )
            rate = {name: batch / s / 1e3 for name, s in times.items()}
            print(
                f"{batch:>6} {'signed' if keyring else 'none':>6} | {rate['insert']:12.1f} "
                f"{rate['exist']:14.1f} {rate['get']:14.1f}"
            )
            cache.close()


def async_insert_table(repeats: int) -> None:
    print(
        "\nAsyncCache.insert_batch over MemoryCache (bf16; ms per call; ratio = AsyncCache / "
        "the bare insert in the same executor)"
    )
    print(f"{'batch':>14} | {'bare':>8} {'AsyncCache':>10} {'ratio':>6}")
    loop = asyncio.new_event_loop()
    try:
        for batch, size in ASYNC_BATCHES:
            async_insert_row(loop, batch, size, repeats)
    finally:
        loop.close()


def async_insert_row(loop: asyncio.AbstractEventLoop, batch: int, size: int, repeats: int) -> None:
    """One row of `async_insert_table`: `batch` tensors of `size` bytes each."""
    keys = [key(i) for i in range(batch)]
    tensors = [torch.randn(size // 2048, 1024).to(torch.bfloat16) for _ in keys]
    cache = MemoryCache(1 << 30)
    wrapped = AsyncCache(cache)

    async def bare() -> list[bool]:
        return await loop.run_in_executor(None, cache.insert_batch, keys, tensors)

    times = best_seconds(
        {
            "bare": lambda: loop.run_until_complete(bare()),
            "async": lambda: loop.run_until_complete(wrapped.insert_batch(keys, tensors)),
        },
        repeats,
    )
    label = f"{batch} x {size >> 10} KiB"
    print(
        f"{label:>14} | {times['bare'] * 1e3:8.3f} {times['async'] * 1e3:10.3f} "
        f"{times['async'] / times['bare']:6.2f}"
    )
    cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per path")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, {platform.machine()}; best of {args.repeats} rounds"
    )
    codec_table(args.repeats)
    auth_table(args.repeats)
    private_table(args.repeats)
    memory_table(args.repeats)
    async_insert_table(args.repeats)


if __name__ == "__main__":
    main()
