"""The scheduler's first look waits a few ms for new items' answers instead of deferring.

A deferral costs vLLM an engine step (its loop sleeps 1 ms and schedules again); where the
lookup thread is idle, a lookup answers in well under a millisecond. So the first look at a
request's new items waits up to ``first_answer_wait_s`` for their answers, bounded, and
defers only if they are not in. Runs in vLLM's environment; skips elsewhere unless
MMKEY_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import (
    connector,
    produce,
    request,
    require_vllm,
    schedule,
    until_available,
    vllm_config,
)

require_vllm()

from mmkey import EmbeddingKey, HashScheme, MemoryCache, Modality, mm_hash  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector  # noqa: E402
from mmkey.integrations.vllm._connector_settings import (  # noqa: E402
    FIRST_ANSWER_WAIT_S,
    MAX_FIRST_ANSWER_WAIT_S,
    ConnectorSettings,
)
from mmkey.integrations.vllm._stager import Staged, Stager  # noqa: E402

STAGERS_WAIT = Stager.wait_answered
ANSWER_BOUND_S = 10.0
"""How long a test waits for an answer that must come (a hang guard, not a timing)."""


class BlockingCache(MemoryCache):
    """A `MemoryCache` whose reads block until `go` is set (a store call under way)."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.go = threading.Event()
        self.entered = threading.Event()

    def get_embeddings(self, keys: Any) -> Any:
        self.entered.set()
        assert self.go.wait(ANSWER_BOUND_S)
        return super().get_embeddings(keys)


@pytest.fixture
def blocking() -> Iterator[BlockingCache]:
    cache = BlockingCache()
    yield cache
    cache.go.set()  # the stager's thread ends its call


def key(n: int) -> EmbeddingKey:
    return EmbeddingKey("first-answer", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(n))


class Waits:
    """Records each `Stager.wait_answered` call and waits, bounded by `ANSWER_BOUND_S`, for
    the real answers: the verdict no longer depends on how busy the host is."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, stager: Stager, names: list[str], timeout: float) -> bool:
        self.calls.append((list(names), timeout))
        return STAGERS_WAIT(stager, names, ANSWER_BOUND_S)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Waits:
    recorded = Waits()
    monkeypatch.setattr(Stager, "wait_answered", lambda self, names, timeout: recorded(self, names, timeout))
    return recorded


def test_a_new_item_answered_within_the_wait_is_not_deferred(waits: Waits) -> None:
    cfg = vllm_config(
        "ec_both", namespace="first-miss", store="memory", first_answer_wait_s=FIRST_ANSWER_WAIT_S
    )
    with connector(cfg, "scheduler") as sched:
        req = request("a", [("img", "image", 4)])
        assert sched.ensure_cache_available(req, 0)  # answered missing at once: encoded here
        assert waits.calls == [(["img"], FIRST_ANSWER_WAIT_S)]
        assert sched.totals().get("deferred", 0) == 0
        assert not sched.has_cache_item("img")


def test_a_hit_answered_within_the_wait_is_served_at_the_first_look(waits: Waits) -> None:
    cfg = vllm_config(
        "ec_both", namespace="first-hit", store="memory", first_answer_wait_s=FIRST_ANSWER_WAIT_S
    )
    tensor = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("img", "image", 4)])])
        produce(worker, meta, {"img": tensor})
        assert worker.flush_saves(ANSWER_BOUND_S)
        waits.calls.clear()
        with connector(cfg, "scheduler") as fresh:  # another instance: it has encoded nothing
            req = request("b", [("img", "image", 4), ("new", "image", 4)])
            assert fresh.ensure_cache_available(req, 0)
            assert waits.calls == [(["img", "new"], FIRST_ANSWER_WAIT_S)]  # one wait for both
            assert fresh.has_cache_item("img") and not fresh.has_cache_item("new")
            assert fresh.totals().get("deferred", 0) == 0


def test_with_the_wait_off_a_first_look_defers_without_waiting(waits: Waits) -> None:
    cfg = vllm_config("ec_both", namespace="first-off", store="memory", first_answer_wait_s=0)
    with connector(cfg, "scheduler") as sched:
        req = request("a", [("img", "image", 4)])
        assert not sched.ensure_cache_available(req, 0)
        assert until_available(sched, req) >= 0
        assert waits.calls == [] and sched.totals()["deferred"] == 1


def stager_of(sched: MMKeyECConnector) -> Stager:
    stager = sched._scheduler._stager
    assert stager is not None
    return stager


def test_a_lookup_slower_than_the_wait_defers_the_request_after_the_wait(blocking: BlockingCache) -> None:
    cfg = vllm_config("ec_both", namespace="first-slow", store="memory", first_answer_wait_s=0.01)
    with connector(cfg, "scheduler") as sched:
        stager_of(sched)._cache = blocking  # its lookups now block until `go`
        req = request("a", [("img", "image", 4)])
        assert not sched.ensure_cache_available(req, 0)  # returned: the wait is bounded
        assert blocking.entered.wait(ANSWER_BOUND_S) and sched.totals()["deferred"] == 1
        blocking.go.set()
        assert until_available(sched, req) >= 0
        assert sched.totals()["deferred"] == 1  # deferred once, as without the wait


def test_a_busy_lookup_thread_is_not_waited_for(blocking: BlockingCache, waits: Waits) -> None:
    """A store call under way (a paused holder: up to the store's timeout) would keep a new
    item's answer past any short wait, so the first look defers at once."""
    cfg = vllm_config(
        "ec_both", namespace="first-busy", store="memory", first_answer_wait_s=MAX_FIRST_ANSWER_WAIT_S
    )
    with connector(cfg, "scheduler") as sched:
        stager_of(sched)._cache = blocking
        stager_of(sched).want("earlier", key(1), 4)
        assert blocking.entered.wait(ANSWER_BOUND_S)  # its call is under way
        assert not sched.ensure_cache_available(request("a", [("img", "image", 4)]), 0)
        assert waits.calls == []


def test_the_stager_is_idle_only_with_nothing_queued_and_no_call_under_way(blocking: BlockingCache) -> None:
    stager = Stager(blocking, fetch=True, max_bytes=1 << 20)
    try:
        assert stager.idle()
        assert stager.want("a", key(2), 4) is Staged.PENDING
        assert blocking.entered.wait(ANSWER_BOUND_S)
        assert not stager.idle()  # in its store call
        assert not stager.wait_answered(["a"], 0.01)  # the bound ends the wait
        blocking.go.set()
        assert stager.wait_answered(["a"], ANSWER_BOUND_S)
        assert stager.state("a") is Staged.MISSING
        assert wait_until(stager.idle, ANSWER_BOUND_S)
        assert stager.wait_answered(["a", "never-asked"], 0.0)  # nothing of them is pending
    finally:
        stager.close()


def test_a_closed_stager_ends_a_wait(blocking: BlockingCache) -> None:
    stager = Stager(blocking, fetch=True, max_bytes=1 << 20)
    stager.want("a", key(3), 4)
    assert blocking.entered.wait(ANSWER_BOUND_S)
    ended = threading.Event()

    def wait() -> None:
        stager.wait_answered(["a"], ANSWER_BOUND_S)
        ended.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    stager.close()
    assert ended.wait(ANSWER_BOUND_S)


def test_the_setting_defaults_to_a_few_ms_and_is_bounded() -> None:
    assert ConnectorSettings().first_answer_wait_s == FIRST_ANSWER_WAIT_S == 0.003
    assert ConnectorSettings.from_extra_config({"first_answer_wait_s": 0}).first_answer_wait_s == 0.0
    assert ConnectorSettings.from_extra_config({"first_answer_wait_s": 0.05}).first_answer_wait_s == 0.05
    for bad, error in (
        ({"first_answer_wait_s": 0.051}, ValueError),
        ({"first_answer_wait_s": -0.001}, ValueError),
    ):
        with pytest.raises(error, match="first_answer_wait_s.*0-0.05 s"):
            ConnectorSettings.from_extra_config(bad)
    for bad_type in (True, "0.003", None):
        with pytest.raises(TypeError, match="first_answer_wait_s.*seconds"):
            ConnectorSettings.from_extra_config({"first_answer_wait_s": bad_type})
