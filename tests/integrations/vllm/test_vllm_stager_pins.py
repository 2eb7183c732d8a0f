"""Pins of `Stager` (the scheduler side's fetches) that the connector tests leave open: what a
first ask costs the store and what a released item leaves counted (found by a mutation pass).

The stager runs on a `MemoryCache`; its answers come from its own thread, so each test waits
until they are filed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from mmkey import (  # noqa: E402
    EmbeddingKey,
    HashScheme,
    MemoryCache,
    Modality,
    MooncakeCache,
    MooncakeConfig,
    identifier_digest,
)
from mmkey.integrations.vllm._stager import Staged, Stager, StagerCounts, claim_wait_of  # noqa: E402
from mmkey.testing.fake_mooncake import FakeMooncakeMaster, FakeMooncakeStore  # noqa: E402

ROWS = 4


def key(name: str) -> EmbeddingKey:
    return EmbeddingKey("stager-pins", Modality.IMAGE, HashScheme.ID, identifier_digest(name))


def embedding(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def cache() -> Iterator[MemoryCache]:
    made = MemoryCache(16 << 20)
    try:
        yield made
    finally:
        made.close()


def answered(stager: Stager, names: Sequence[str]) -> bool:
    return all(stager.state(name) not in (Staged.PENDING, None) for name in names)


def test_a_new_stager_counts_nothing(cache: MemoryCache) -> None:
    """Every counter of a stager that was asked nothing is zero."""
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        counts = stager.counts()
        assert attrs.asdict(counts) == dict.fromkeys(attrs.asdict(counts), 0)
        assert counts == StagerCounts()
    finally:
        stager.close()


def test_released_items_leave_no_staged_bytes_found_or_not(cache: MemoryCache) -> None:
    """Staged bytes count what is held: released items, missing ones included, leave none."""
    cache.insert_batch([key("found")], [embedding(1)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        assert stager.want("found", key("found"), ROWS) is Staged.PENDING
        assert stager.want("missing", key("missing"), ROWS) is Staged.PENDING
        assert wait_until(lambda: answered(stager, ["found", "missing"]), 10.0, poll=0.0005)
        assert stager.state("found") is Staged.STAGED and stager.state("missing") is Staged.MISSING
        size = embedding(1).numel() * embedding(1).element_size()
        assert stager.counts().staged_bytes == size
        stager.release("missing")
        assert stager.counts().staged_bytes == size
        stager.release("found")
        assert stager.counts().staged_bytes == 0
    finally:
        stager.close()


def test_a_first_ask_is_one_read_with_no_existence_check(
    cache: MemoryCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer's first ask of an item reads it, once; the store is not asked first whether
    it exists."""
    checks: list[int] = []
    reads: list[int] = []
    real_exist, real_get = cache.batch_is_exist, cache.get_embeddings

    def exist(keys: Sequence[EmbeddingKey]) -> list[bool]:
        checks.append(len(keys))
        return real_exist(keys)

    def get(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        reads.append(len(keys))
        return real_get(keys)

    monkeypatch.setattr(cache, "batch_is_exist", exist)
    monkeypatch.setattr(cache, "get_embeddings", get)
    cache.insert_batch([key("a")], [embedding(2)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("a", key("a"), ROWS)
        stager.want("b", key("b"), ROWS)
        assert wait_until(lambda: answered(stager, ["a", "b"]), 10.0, poll=0.0005)
        assert stager.state("a") is Staged.STAGED and stager.state("b") is Staged.MISSING
        assert checks == [] and sum(reads) == 2  # each read once, in one call or two
    finally:
        stager.close()


class _OddWait(MooncakeCache):
    """A claiming cache whose ``claim_wait`` is whatever the test sets."""

    wait: object = 2.0

    @property
    def claim_wait(self) -> float:
        return self.wait  # type: ignore[return-value]  # what a broken cache may answer


@pytest.mark.parametrize("wait", [True, False, -1.0, 0, "3", None])
def test_claims_are_off_unless_claim_wait_is_a_positive_number(wait: object) -> None:
    """`claim_wait_of` turns claims on only for a positive number of seconds (a bool is not
    one); anything else a cache answers means claims off."""
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 << 20)
        cache = _OddWait(config, store_class=FakeMooncakeStore)
        with cache:
            assert claim_wait_of(cache) == 2.0 and type(claim_wait_of(cache)) is float
            cache.wait = wait
            assert claim_wait_of(cache) == 0.0
            cache.wait = 3
            assert claim_wait_of(cache) == 3.0


def test_a_stager_claims_only_when_asked_to() -> None:
    """Over a cache with claims on, a stager made without ``claims`` claims no missing item."""
    with FakeMooncakeMaster() as master:
        config = MooncakeConfig(
            master_server_address=master.address, local_buffer_size=4 << 20, claim_wait=2.0
        )
        with MooncakeCache(config, store_class=FakeMooncakeStore) as cache:
            stager = Stager(cache, fetch=True, max_bytes=1 << 20)
            try:
                stager.want("x", key("x"), ROWS)
                assert wait_until(lambda: answered(stager, ["x"]), 10.0, poll=0.0005)
                assert stager.state("x") is Staged.MISSING
                assert stager.claims() == [] and stager.counts().claims_won == 0
                assert master.calls["batch_put_session_start"] == 0
            finally:
                stager.close()
