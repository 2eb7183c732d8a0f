"""`MooncakeCache`'s own checks on the fake store: registered memory refused or not recorded
(and said so once), and a cache whose construction failed being collected quietly."""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mmkey import EmbeddingKey, HashScheme, Modality, MooncakeCache, mm_hash
from mmkey.cache.protocol import Claim
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore
from tests.cache.mooncake.pins_support import fake_config


@pytest.fixture
def master() -> Iterator[FakeMooncakeMaster]:
    with FakeMooncakeMaster() as m:
        yield m


def make_cache(master: FakeMooncakeMaster, **overrides: Any) -> MooncakeCache:
    return MooncakeCache(fake_config(master, **overrides), keyring=None, store_class=FakeMooncakeStore)


def test_memory_not_registered_without_trusted_network_is_said_once(
    master: FakeMooncakeMaster, caplog: pytest.LogCaptureFixture
) -> None:
    with make_cache(master) as cache, caplog.at_level(logging.INFO, logger="mmkey.cache.mooncake"):
        for _ in range(3):
            cache.register_memory(torch.zeros(16))
        said = [r for r in caplog.records if "trusted_network is off" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.INFO
        assert cache._transport.region_of(0, 0) is None and cache._transport._regions == []


def test_empty_memory_is_refused_and_one_element_is_registered(master: FakeMooncakeMaster) -> None:
    with make_cache(master, trusted_network=True) as cache:
        with pytest.raises(TypeError, match="non-empty contiguous CPU tensor"):
            cache.register_memory(torch.zeros(0))
        one = torch.ones(1)
        cache.register_memory(one)
        assert cache._transport.region_of(one.data_ptr(), 4) is not None


def test_a_cache_whose_construction_failed_is_collected_without_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            MooncakeCache("127.0.0.1:9", keyring=None)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            pytest.fail("a config that is not a MooncakeConfig was taken")
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert unraisable == []


def test_with_claims_off_a_wait_is_none_at_once_and_counted_nowhere(master: FakeMooncakeMaster) -> None:
    """``claim_wait`` 0: `wait_for_embeddings` answers None per key without asking the store."""
    with make_cache(master, claim_wait=0.0) as cache:
        k = EmbeddingKey("cache-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(1))
        assert cache.insert_batch([k], [torch.ones(4)]) == [True]
        calls = sum(master.calls.values())
        assert cache.wait_for_embeddings([k, k]) == [None, None]
        assert cache.claim([k]) == [Claim.UNCLAIMED]
        assert sum(master.calls.values()) == calls
        stats = cache.stats()
        assert (stats.waits_served, stats.waits_timed_out, stats.coalesced, stats.hits) == (0, 0, 0, 0)


@pytest.mark.parametrize("trusted", [False, True], ids=["staged", "registered"])
def test_insert_from_a_silent_master_stores_nothing(master: FakeMooncakeMaster, trusted: bool) -> None:
    """A payload the store never took is reported not stored, whichever way it would have gone."""
    pool = torch.arange(16, dtype=torch.float32)
    with make_cache(master, trusted_network=trusted) as cache:
        cache.register_memory(pool)
        k = EmbeddingKey("cache-pins", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(2))
        master.kill()
        try:
            assert cache.insert_from([k], [pool[:8]]) == [False]
            assert cache.stats().inserts == 0
        finally:
            master.restart()


def test_the_never_closed_warning_points_at_the_code_that_dropped_the_cache(
    master: FakeMooncakeMaster,
) -> None:
    """The `ResourceWarning` names the caller's line (the one that let the cache go), not mmkey's."""
    cache = make_cache(master)
    try:
        with pytest.warns(ResourceWarning, match="never closed") as caught:
            cache.__del__()
        assert [w.filename for w in caught] == [__file__]
    finally:
        cache.close()
