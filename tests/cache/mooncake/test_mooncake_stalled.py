"""A transfer stuck on a stopped holder ends at the store's timeout (rounded up to whole
seconds), not after the binding's 30 s, during which it keeps a core of the client busy."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, MooncakeConfig, mm_hash
from mmkey.cache.mooncake._net import PROGRESS_ENV, bound_stalled_transfers
from mmkey.testing.fleet import Fleet, running_fleet
from mmkey.testing.pytest_plugin import _require_fleet
from tests._support import wait_until


@pytest.mark.parametrize(("timeout", "seconds"), [(0.05, "1"), (0.5, "1"), (1.0, "1"), (2.2, "3")])
def test_the_progress_deadline_is_the_timeout_in_whole_seconds(
    monkeypatch: pytest.MonkeyPatch, timeout: float, seconds: str
) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    bound_stalled_transfers(timeout)
    assert os.environ[PROGRESS_ENV] == seconds


def test_a_deadline_the_process_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "30")
    bound_stalled_transfers(0.5)
    assert os.environ[PROGRESS_ENV] == "30"


@pytest.fixture
def one_holder() -> Iterator[Fleet]:
    _require_fleet()
    with running_fleet(holders=1, segment_size=64 << 20) as fleet:
        yield fleet


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


@pytest.mark.mooncake
@pytest.mark.serial  # measures this process's CPU time and a 0.2 s lookup: alone, not beside the suite
def test_a_read_stuck_on_a_stopped_holder_frees_its_lane_and_the_cpu(
    one_holder: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    config = MooncakeConfig(
        master_server_address=one_holder.master.address,
        global_segment_size=0,
        local_buffer_size=32 << 20,
        timeout=0.2,
    )
    cache = MooncakeCache(config, keyring=None)
    try:
        key = EmbeddingKey("stalled", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1))
        assert cache.insert_batch([key], [torch.ones(64, 64)]) == [True]
        one_holder.holders[0].pause()
        try:
            assert cache.get_embeddings([key]) == [None]  # a miss at the timeout
            assert cache.health().busy_lanes == 1, "the transfer is still under way in the binding"
            # the binding ends it at its progress deadline (1 s here), not after 30 s of spinning
            assert wait_until(lambda: cache.health().busy_lanes == 0, 10)
            before = _cpu_s()
            assert not wait_until(lambda: False, 1.0)  # a second with the holder still stopped
            assert _cpu_s() - before < 0.5, "nothing of this process spins on the stopped holder"
        finally:
            one_holder.holders[0].resume()
        assert wait_until(lambda: cache.get_embeddings([key])[0] is not None, 10)
    finally:
        cache.close()
