"""Against a real local master: memory registered with Mooncake is writable by anyone who
reaches the process's transfer ports, and nothing written there is ever served.

A stranger process (``registered_memory_writer.py``, loopback only, a bounded run) finds
every registered buffer of the cache's process through Mooncake's anonymous handshake and
overwrites them with its own bytes while the cache inserts and reads. Served embeddings
are exactly the genuine ones; the rest are misses.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from mmkey import EmbeddingKey, EntryKeyring, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.testing.mooncake_master import MasterProcess
from tests._support import MiB, count_multi_buffer_puts, local_config, raw_client
from tests.cache.mooncake.registered_memory_writer import FILL, describe

pytestmark = pytest.mark.mooncake

RUN = uuid.uuid4().hex[:12]
RING = EntryKeyring.from_secrets(hashlib.sha256(b"registered memory tests").digest())
WRITER = Path(__file__).with_name("registered_memory_writer.py")
ATTACK_S = 6.0
"""How long the stranger writes (and the cache works under it)."""


def key(i: int) -> EmbeddingKey:
    return EmbeddingKey(f"stranger-{RUN}", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(i))


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_stranger_writing_into_every_registered_buffer_never_gets_its_bytes_served(
    mooncake_master_session: MasterProcess,
) -> None:
    holder_cfg = local_config(mooncake_master_session, global_segment_size=256 * MiB)
    with raw_client(holder_cfg):  # entries live here, not in the cache's process
        before = listening_ports()
        cfg = local_config(
            mooncake_master_session, global_segment_size=0, local_buffer_size=4 * MiB, timeout=5.0
        )
        with MooncakeCache(cfg, keyring=RING) as cache:
            keys = [key(i) for i in range(48)]
            genuine = [torch.randn(128, 128) for _ in keys]  # 64 KiB each
            pool = torch.zeros(48 * 128, 128)
            cache.register_memory(pool)  # not registered: trusted_network is off
            assert cache.insert_batch(keys, genuine) == [True] * 48
            assert all(t is not None for t in cache.get_embeddings(keys))  # staging in use
            ports = listening_ports() - before
            found = [d for d in (describe(p) for p in ports) if d is not None]
            assert found, f"no handshake port among {ports}"
            listed = [
                (int(b["addr"]), int(b["length"]))
                for d in found
                for b in cast("list[dict[str, Any]]", d["buffers"])
            ]
            start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * 4
            assert not any(a < end and start < a + n for a, n in listed)  # the pool is private

            stranger = subprocess.Popen(
                [sys.executable, str(WRITER), str(ATTACK_S), *map(str, ports)],
                stdout=subprocess.PIPE,
                env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
            )
            served = refused = 0
            try:
                stop = time.monotonic() + ATTACK_S
                while time.monotonic() < stop:
                    half = len(keys) // 2
                    assert cache.insert_batch(keys[:half], genuine[:half]) == [True] * half
                    for i, t in enumerate(genuine[half:], half):
                        pool[i * 128 : (i + 1) * 128] = t
                    pages = [
                        [pool[i * 128 : i * 128 + 64], pool[i * 128 + 64 : (i + 1) * 128]]
                        for i in range(half, len(keys))
                    ]
                    assert cache.insert_from(keys[half:], pages) == [True] * (len(keys) - half)
                    for got, want in zip(cache.get_embeddings(keys), genuine, strict=True):
                        if got is None:
                            refused += 1
                        else:
                            assert torch.equal(got, want)
                            served += 1
                    targets = [torch.full((128, 128), -1.0) for _ in keys]
                    landed = cache.read_into(keys, targets)
                    for ok, target, want in zip(landed, targets, genuine, strict=True):
                        assert torch.equal(target, want) if ok else bool((target == -1.0).all())
            finally:
                out, _ = stranger.communicate(timeout=ATTACK_S + 30)
            report = json.loads(out.decode().strip().splitlines()[-1])
            stats = cache.stats()
    assert report["landed"] > 0, report  # the stranger did write into the cache's memory
    assert served > 0
    fill = torch.frombuffer(bytearray([FILL] * 4), dtype=torch.float32).item()
    assert not any(bool((t == fill).any()) for t in genuine)  # the control
    print(f"stranger {report}; served {served}, refused {refused}; {stats}")


def test_without_trusted_network_pools_are_not_registered_and_puts_go_through_staging(
    mooncake_master_session: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    multi_buffer_puts = count_multi_buffer_puts(monkeypatch)
    pool = torch.randn(64, 32)
    with MooncakeCache(local_config(mooncake_master_session, timeout=5.0), keyring=RING) as cache:
        assert not cache.config.trusted_network
        cache.register_memory(pool)
        cache.register_memory(pool)  # nothing recorded: no overlap either
        assert cache.insert_from([key(900)], [[pool[:8], pool[16:24]]]) == [True]
        out = torch.zeros(16, 32)
        assert cache.read_into([key(900)], [out]) == [True]
        assert torch.equal(out, torch.cat([pool[:8], pool[16:24]]))
    assert multi_buffer_puts == []  # never straight from the pool
