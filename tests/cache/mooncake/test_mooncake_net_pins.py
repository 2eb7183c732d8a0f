"""`master_answers` against a listener that never replies, with the module's clock moved past
the probe's deadline: a reply that has not come by then is no answer."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from mmkey.cache.mooncake import _net


def test_a_reply_not_come_by_the_deadline_is_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([100.0, 200.0])  # the deadline is taken, then the clock has passed it
    clock = SimpleNamespace(monotonic=lambda: next(readings, 300.0))
    monkeypatch.setattr(_net, "time", clock)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        assert not _net.master_answers("127.0.0.1", silent.getsockname()[1], 5.0)
