"""Pins of `Stager` (the scheduler side's fetches) that the connector tests leave open: what a
first ask costs the store and what a released item leaves counted (found by a mutation pass).

The stager runs on a `MemoryCache`; its answers come from its own thread, so each test waits
until they are filed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

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
from mmkey.cache.protocol import Claim  # noqa: E402
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


def counting_calls(cache: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The sizes of `cache`'s existence checks and of its reads, recorded from now on."""
    checks: list[int] = []
    reads: list[int] = []
    real_exist, real_get = cache.batch_is_exist, cache.get_embeddings

    def exist(keys: Sequence[EmbeddingKey]) -> list[bool]:
        checks.append(len(keys))
        return list(real_exist(keys))

    def get(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        reads.append(len(keys))
        return list(real_get(keys))

    monkeypatch.setattr(cache, "batch_is_exist", exist)
    monkeypatch.setattr(cache, "get_embeddings", get)
    return checks, reads


def claiming_cache(master: FakeMooncakeMaster) -> MooncakeCache:
    """A client of `master` that claims what it finds missing (for up to 2 s)."""
    config = MooncakeConfig(master_server_address=master.address, local_buffer_size=4 << 20, claim_wait=2.0)
    return MooncakeCache(config, store_class=FakeMooncakeStore)


@contextlib.contextmanager
def claiming_stager(cache: MooncakeCache) -> Iterator[Stager]:
    """A fetching stager of `cache` with claims on, holding claims 10 s; closed on the way out."""
    stager = Stager(cache, fetch=True, max_bytes=1 << 20, claims=True, hold_s=10.0)
    try:
        yield stager
    finally:
        stager.close()


def answered(stager: Stager, names: Sequence[str]) -> bool:
    return all(stager.state(name) not in (Staged.PENDING, None) for name in names)


def wait_answered(stager: Stager, names: Sequence[str]) -> None:
    """Wait until the stager filed an answer for each of `names` (a hang guard, not a timing)."""
    assert wait_until(lambda: answered(stager, names), 10.0, poll=0.0005)


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
        wait_answered(stager, ["found", "missing"])
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
    checks, reads = counting_calls(cache, monkeypatch)
    cache.insert_batch([key("a")], [embedding(2)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("a", key("a"), ROWS)
        stager.want("b", key("b"), ROWS)
        wait_answered(stager, ["a", "b"])
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
    with FakeMooncakeMaster() as master, claiming_cache(master) as cache:
        stager = Stager(cache, fetch=True, max_bytes=1 << 20)
        try:
            stager.want("x", key("x"), ROWS)
            wait_answered(stager, ["x"])
            assert stager.state("x") is Staged.MISSING
            assert stager.claims() == [] and stager.counts().claims_won == 0
            assert master.calls["batch_put_session_start"] == 0
        finally:
            stager.close()


def test_won_is_false_for_an_item_asked_but_not_claimed(cache: MemoryCache) -> None:
    """`won` is true only for a claim this stager holds: not for a known item it did not claim."""
    cache.insert_batch([key("here")], [embedding(3)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("here", key("here"), ROWS)
        stager.want("gone", key("gone"), ROWS)
        wait_answered(stager, ["here", "gone"])
        assert stager.state("here") is Staged.STAGED and stager.state("gone") is Staged.MISSING
        assert not stager.won("here") and not stager.won("gone") and not stager.won("never")
    finally:
        stager.close()


def test_a_held_item_retried_is_claimed_again_once_its_claimant_gave_up() -> None:
    """`retry` claims by default: a `HELD` item whose claimant let go is taken over (won here)."""
    with (
        FakeMooncakeMaster() as master,
        claiming_cache(master) as other,
        claiming_cache(master) as cache,
    ):
        assert other.claim([key("held")]) == [Claim.WON]
        with claiming_stager(cache) as stager:
            stager.want("held", key("held"), ROWS)
            wait_answered(stager, ["held"])
            assert stager.state("held") is Staged.HELD and not stager.won("held")
            other.release([key("held")])  # revoked on its lane, without waiting

            def taken_over() -> bool:  # retried (claiming by default) until the revoke lands
                if stager.state("held") is Staged.HELD:
                    stager.retry("held")
                return stager.state("held") is Staged.MISSING and stager.won("held")

            assert wait_until(taken_over, 10.0, poll=0.005)
            assert stager.claims() == [key("held").to_key()]


def test_a_stager_holding_no_claim_asks_no_release_of_a_closed_cache() -> None:
    """Closing a claiming stager that holds no claim calls no release: a cache closed first
    reports no error through ``on_error``."""
    errors: list[str] = []
    with FakeMooncakeMaster() as master:
        cache = claiming_cache(master)
        stager = Stager(cache, fetch=True, max_bytes=1 << 20, claims=True, on_error=errors.append)
        try:
            cache.insert_batch([key("kept")], [embedding(4)])
            stager.want("kept", key("kept"), ROWS)
            wait_answered(stager, ["kept"])
            assert stager.state("kept") is Staged.STAGED and stager.claims() == []
        finally:
            cache.close()
            stager.close()
        assert errors == []


def test_release_claims_counts_only_claims_it_held() -> None:
    """`release_claims` releases and counts the held claims among the texts of a collection;
    any other text, a non-text or a bare string releases nothing."""
    with (
        FakeMooncakeMaster() as master,
        claiming_cache(master) as cache,
        claiming_stager(cache) as stager,
    ):
        stager.want("a", key("a"), ROWS)
        stager.want("b", key("b"), ROWS)
        wait_answered(stager, ["a", "b"])
        a, b = key("a").to_key(), key("b").to_key()
        assert sorted(stager.claims()) == sorted([a, b])
        assert stager.release_claims(b) == 0 and stager.release_claims(None) == 0
        assert stager.release_claims([a, "not-held", 5]) == 1
        assert stager.claims() == [b]
        assert stager.release_claims(frozenset({a, b})) == 1
        assert stager.claims() == []


def test_answered_counts_the_answers_filed_and_close_frees_every_byte(cache: MemoryCache) -> None:
    """`answered` starts at zero and counts each item answered; after `close` no byte is held."""
    cache.insert_batch([key("one")], [embedding(5)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        assert stager.answered() == 0
        stager.want("one", key("one"), ROWS)
        stager.want("two", key("two"), ROWS)
        wait_answered(stager, ["one", "two"])
        assert stager.answered() == 2 and stager.counts().staged_bytes > 0
    finally:
        stager.close()
    assert stager.counts().staged_bytes == 0 and stager.state("one") is None


def test_asking_a_name_again_for_another_item_frees_what_it_held(cache: MemoryCache) -> None:
    """`want` of a known name with another key or row count drops what the name held first."""
    cache.insert_batch([key("first")], [embedding(6)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("slot", key("first"), ROWS)
        wait_answered(stager, ["slot"])
        assert stager.state("slot") is Staged.STAGED and stager.counts().staged_bytes > 0
        assert stager.want("slot", key("second"), ROWS) is Staged.PENDING
        wait_answered(stager, ["slot"])
        assert stager.state("slot") is Staged.MISSING and stager.counts().staged_bytes == 0
    finally:
        stager.close()


def test_retry_asks_again_only_for_a_missing_or_held_item(cache: MemoryCache) -> None:
    """`retry` of a staged item leaves it staged, of an unknown name does nothing."""
    cache.insert_batch([key("staged")], [embedding(7)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("staged", key("staged"), ROWS)
        wait_answered(stager, ["staged"])
        size = stager.counts().staged_bytes
        stager.retry("staged")
        stager.retry("unknown")
        assert stager.state("staged") is Staged.STAGED and stager.state("unknown") is None
        assert stager.counts().staged_bytes == size
    finally:
        stager.close()


def test_give_back_releases_only_a_won_claim_whose_save_is_not_planned() -> None:
    """`give_back` leaves a name without a claim, an unknown name and a claim whose save is
    planned as they are; a won claim of a missing item is released and the item `HELD`."""
    with FakeMooncakeMaster() as master, claiming_cache(master) as cache:
        cache.insert_batch([key("stored")], [embedding(8)])
        with claiming_stager(cache) as stager:
            for name in ("stored", "mine", "saved"):
                stager.want(name, key(name), ROWS)
            wait_answered(stager, ["stored", "mine", "saved"])
            assert stager.won("mine") and stager.won("saved") and not stager.won("stored")
            stager.saving(key("saved").to_key())
            stager.give_back("unknown")
            stager.give_back("stored")
            stager.give_back("saved")
            assert stager.state("stored") is Staged.STAGED
            assert stager.state("saved") is Staged.MISSING and stager.won("saved")
            stager.give_back("mine")
            assert stager.state("mine") is Staged.HELD and not stager.won("mine")
            assert stager.claims() == [key("saved").to_key()]


def test_take_hands_over_only_a_staged_item(cache: MemoryCache) -> None:
    """`take` of an unknown or missing name gives ``None`` and forgets nothing; of a staged one,
    its tensor, and the name is forgotten."""
    cache.insert_batch([key("ready")], [embedding(9)])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("ready", key("ready"), ROWS)
        stager.want("absent", key("absent"), ROWS)
        wait_answered(stager, ["ready", "absent"])
        assert stager.take("unknown") is None
        assert stager.take("absent") is None and stager.state("absent") is Staged.MISSING
        tensor = stager.take("ready")
        assert tensor is not None and torch.equal(tensor, embedding(9))
        assert stager.state("ready") is None and stager.counts().staged_bytes == 0
    finally:
        stager.close()


def test_a_held_item_asked_again_while_absent_is_looked_up_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `HELD` item asked again is looked up first: still absent, it is not read again."""
    with (
        FakeMooncakeMaster() as master,
        claiming_cache(master) as other,
        claiming_cache(master) as cache,
    ):
        checks, reads = counting_calls(cache, monkeypatch)
        assert other.claim([key("waited")]) == [Claim.WON]
        with claiming_stager(cache) as stager:
            stager.want("waited", key("waited"), ROWS)
            wait_answered(stager, ["waited"])
            assert stager.state("waited") is Staged.HELD and reads == [1] and checks == []
            stager.retry("waited", claim=False)
            wait_answered(stager, ["waited"])
            assert stager.state("waited") is Staged.HELD
            assert checks == [1] and reads == [1]


def test_the_stager_thread_is_a_named_daemon(cache: MemoryCache) -> None:
    """The stager's thread carries its ``name`` and is a daemon: it never keeps a process alive."""
    stager = Stager(cache, fetch=True, max_bytes=1 << 20, name="stager-pins-daemon")
    try:
        (thread,) = [t for t in threading.enumerate() if t.name == "stager-pins-daemon"]
        assert thread.daemon
    finally:
        stager.close()


def test_close_stops_the_stager_thread(cache: MemoryCache) -> None:
    """`close` stops the stager's thread: it ends soon after, not left waiting for work."""
    stager = Stager(cache, fetch=True, max_bytes=1 << 20, name="stager-pins-closing")
    (thread,) = [t for t in threading.enumerate() if t.name == "stager-pins-closing"]
    stager.close()
    assert wait_until(lambda: not thread.is_alive(), 10.0, poll=0.0005)


@pytest.mark.parametrize("fault", ["raises", "short-answer"])
def test_an_existence_check_that_fails_leaves_its_items_missing(
    cache: MemoryCache, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A producer's existence check that raises, or answers for fewer keys than it was asked,
    leaves every item `MISSING` (encoded and saved), never known stored."""
    cache.insert_batch([key("p"), key("q")], [embedding(10), embedding(11)])

    def failing(keys: Sequence[EmbeddingKey]) -> list[bool]:
        if fault == "raises":
            raise RuntimeError("store down")
        return [True] * (len(keys) - 1)

    monkeypatch.setattr(cache, "batch_is_exist", failing)
    stager = Stager(cache, fetch=False, max_bytes=1 << 20)
    try:
        stager.want("p", key("p"), ROWS)
        stager.want("q", key("q"), ROWS)
        wait_answered(stager, ["p", "q"])
        assert stager.state("p") is Staged.MISSING and stager.state("q") is Staged.MISSING
        assert (stager.counts().store_errors > 0) == (fault == "raises")  # one call or two
    finally:
        stager.close()


def blocking_reads(cache: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make `cache`'s reads wait for the second event; the first is set once a read began."""
    entered, go = threading.Event(), threading.Event()
    real_get = cache.get_embeddings

    def get(keys: Sequence[EmbeddingKey]) -> list[torch.Tensor | None]:
        entered.set()
        assert go.wait(10.0)
        return list(real_get(keys))

    monkeypatch.setattr(cache, "get_embeddings", get)
    return entered, go


@pytest.mark.parametrize("meanwhile", ["released", "asked-for-another-key"])
def test_an_answer_for_an_item_released_or_replaced_meanwhile_is_not_held(
    cache: MemoryCache, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """An item released, or its name asked again for another key, while its read is under way:
    the read's answer is dropped, holding no bytes."""
    cache.insert_batch([key("slow")], [embedding(12)])
    entered, go = blocking_reads(cache, monkeypatch)
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("slot", key("slow"), ROWS)
        assert entered.wait(10.0)
        if meanwhile == "released":
            stager.release("slot")
        else:
            stager.want("slot", key("absent"), ROWS)
        go.set()
        assert wait_until(
            lambda: stager.idle() and stager.state("slot") is not Staged.PENDING, 10.0, poll=0.0005
        )
        assert stager.state("slot") == (None if meanwhile == "released" else Staged.MISSING)
        assert stager.counts().staged_bytes == 0 and stager.counts().staged == 0
    finally:
        go.set()
        stager.close()


def test_an_entrys_rows_are_its_first_dimension_and_a_scalar_has_none(cache: MemoryCache) -> None:
    """An entry of one dimension holding ``rows`` values is of the expected size (staged); a
    scalar entry has no rows: of the wrong size, missing."""
    cache.insert_batch([key("flat"), key("scalar")], [torch.ones(ROWS), torch.tensor(float(ROWS))])
    stager = Stager(cache, fetch=True, max_bytes=1 << 20)
    try:
        stager.want("flat", key("flat"), ROWS)
        stager.want("scalar", key("scalar"), ROWS)
        wait_answered(stager, ["flat", "scalar"])
        assert stager.state("flat") is Staged.STAGED and stager.state("scalar") is Staged.MISSING
        assert stager.counts().wrong_size == 1 and stager.counts().staged == 1
    finally:
        stager.close()


def test_a_claim_won_for_an_item_released_meanwhile_is_given_up() -> None:
    """An item released while its read is under way, then found missing and claimed: nobody
    wants the claim now, so it is released at once (another claimant wins it)."""
    with (
        FakeMooncakeMaster() as master,
        claiming_cache(master) as other,
        claiming_cache(master) as cache,
        pytest.MonkeyPatch.context() as monkeypatch,
    ):
        entered, go = blocking_reads(cache, monkeypatch)
        with claiming_stager(cache) as stager:
            try:
                stager.want("gone", key("gone"), ROWS)
                assert entered.wait(10.0)
                stager.release("gone")
                go.set()
                assert wait_until(lambda: stager.answered() == 1 and stager.idle(), 10.0, poll=0.0005)
                assert stager.counts().claims_won == 1 and stager.claims() == []
                assert wait_until(lambda: other.claim([key("gone")]) == [Claim.WON], 10.0, poll=0.005)
            finally:
                go.set()


def test_an_answer_that_an_item_is_claimed_elsewhere_is_counted_once() -> None:
    """``claims_held`` counts each answer that another claimant holds an item: one here."""
    with (
        FakeMooncakeMaster() as master,
        claiming_cache(master) as other,
        claiming_cache(master) as cache,
    ):
        assert other.claim([key("theirs")]) == [Claim.WON]
        with claiming_stager(cache) as stager:
            stager.want("theirs", key("theirs"), ROWS)
            wait_answered(stager, ["theirs"])
            assert stager.state("theirs") is Staged.HELD
            assert stager.counts().claims_held == 1 and stager.counts().claims_won == 0
