"""A producer's save waits for the engine step that encoded it to end.

vLLM calls ``save_caches`` in the middle of a step, before the language model's forward pass;
a save written at once takes CPU (and the GIL) from that pass, so from the request's time to
first token. The worker's saver holds each save until vLLM binds the next step's metadata, or
``save_hold_s`` at most (its absolute bound: an engine with no next step). Runs in vLLM's
environment; skips elsewhere unless MMKEY_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import pytest
import torch

from tests._support import wait_until
from tests.integrations.vllm.vllm_support import (
    connector,
    produce,
    producer_only_config,
    request,
    require_vllm,
    schedule,
)

require_vllm()

from mmkey import Modality  # noqa: E402
from mmkey.integrations._background_saver import MAX_HOLD_S  # noqa: E402
from mmkey.integrations.vllm import MMKeyECConnector  # noqa: E402
from mmkey.integrations.vllm._connector_settings import SAVE_HOLD_S, ConnectorSettings  # noqa: E402
from mmkey.integrations.vllm._metadata import MMKeyECMetadata  # noqa: E402

LANDS_WITHIN_S = 10.0
"""How long a test waits for a save that must land (a hang guard, not a timing)."""


def held(worker: MMKeyECConnector) -> int:
    counts = worker._worker.saver_counts()
    assert counts is not None
    return counts.held


def stored(sched: MMKeyECConnector, identifier: str) -> bool:
    return sched.cache.batch_is_exist([sched.key(identifier, Modality.IMAGE)]) == [True]


def test_a_save_is_held_until_vllm_binds_the_next_steps_metadata() -> None:
    cfg = producer_only_config(namespace="hold-step", store="memory", save_hold_s=MAX_HOLD_S)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("x", "image", 3)])])
        produce(worker, meta, {"x": torch.ones(3, 8)})
        assert held(worker) == 1 and not stored(sched, "x")  # the step's forward pass runs now
        produce(worker, MMKeyECMetadata((), {}), {})  # the next step: vLLM binds its metadata
        assert wait_until(lambda: stored(sched, "x"), LANDS_WITHIN_S)
        assert held(worker) == 0


def test_without_a_next_step_a_save_lands_once_its_hold_has_passed() -> None:
    cfg = producer_only_config(namespace="hold-bound", store="memory", save_hold_s=0.05)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("x", "image", 3)])])
        produce(worker, meta, {"x": torch.ones(3, 8)})
        assert wait_until(lambda: stored(sched, "x"), LANDS_WITHIN_S), "no step binds: the bound"


def test_save_hold_zero_starts_saves_at_once() -> None:
    cfg = producer_only_config(namespace="hold-off", store="memory", save_hold_s=0)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("x", "image", 3)])])
        produce(worker, meta, {"x": torch.ones(3, 8)})
        assert held(worker) == 0
        assert wait_until(lambda: stored(sched, "x"), LANDS_WITHIN_S)


def test_a_flush_writes_held_saves() -> None:
    cfg = producer_only_config(namespace="hold-flush", store="memory", save_hold_s=MAX_HOLD_S)
    with connector(cfg, "scheduler") as sched, connector(cfg, "worker") as worker:
        meta, _ = schedule(sched, [request("a", [("x", "image", 3)])])
        produce(worker, meta, {"x": torch.ones(3, 8)})
        assert worker.flush_saves(LANDS_WITHIN_S) and stored(sched, "x")


def test_the_save_hold_setting() -> None:
    assert ConnectorSettings().save_hold_s == SAVE_HOLD_S == 0.05
    assert ConnectorSettings.from_extra_config({"save_hold_s": 0}).save_hold_s == 0.0
    assert ConnectorSettings.from_extra_config({"save_hold_s": 1}).save_hold_s == MAX_HOLD_S
    for bad in (1.01, -0.001):
        with pytest.raises(ValueError, match=r"save_hold_s.*0-1.0 s"):
            ConnectorSettings.from_extra_config({"save_hold_s": bad})
    for bad_type in ("0.1", None):
        with pytest.raises(TypeError, match="save_hold_s.*seconds"):
            ConnectorSettings.from_extra_config({"save_hold_s": bad_type})
