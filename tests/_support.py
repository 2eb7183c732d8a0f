"""Helpers the test modules share: polling, the guard of a stack's tests, a local store's config."""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

    from mmkey.cache.mooncake.config import MooncakeConfig
    from mmkey.testing.mooncake_master import MasterProcess

__all__ = [
    "MiB",
    "ROOMY_TIMEOUT",
    "count_multi_buffer_puts",
    "local_config",
    "raw_client",
    "require_stack",
    "timed",
    "wait_until",
]

MiB = 1 << 20
ROOMY_TIMEOUT = 5.0
"""The store deadline of a test that faults no master: only a hang may fail it (sub-second
deadlines missed plain round trips on a crowded host). Each module's ``config`` helper
defaults to it; the tests of hung, dead or slow masters ask for their module's short
``TIMEOUT``."""


def wait_until(predicate: Callable[[], object], seconds: float, *, poll: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``seconds`` pass; whether it held in the end."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()``'s result and the seconds it took (for bounds that catch hangs, never speed)."""
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def require_stack(module: str, *, stack: str, require_env: str, make_target: str) -> None:
    """Skip the calling test module when ``module`` does not import (a failure when the
    ``require_env`` variable is set, as in CI)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        reason = f"{stack} is not importable here ({exc}); run `make {make_target}`"
        if os.environ.get(require_env, "") not in ("", "0"):
            pytest.fail(f"{require_env} is set but {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def local_config(master: MasterProcess, **overrides: Any) -> MooncakeConfig:
    """A `MooncakeConfig` for a store on a test master: a small segment and buffer, a quick
    setup and retry; ``overrides`` win."""
    from mmkey.cache.mooncake.config import MooncakeConfig

    fields: dict[str, Any] = {
        "master_server_address": master.address,
        "global_segment_size": 64 * MiB,
        "local_buffer_size": 16 * MiB,
        "setup_timeout": 5.0,
        "retry_after": 0.2,
    }
    fields.update(overrides)
    return MooncakeConfig(**fields)


def count_multi_buffer_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, stores made by `MooncakeCache` are the real binding's class with its
    ``batch_put_from_multi_buffers`` calls recorded: the list gets each call's key count."""
    import mooncake.store

    calls: list[int] = []
    real = mooncake.store.MooncakeDistributedStore

    class Counting(real):  # type: ignore[misc, valid-type]
        def batch_put_from_multi_buffers(self, keys: list[str], *args: Any, **kwargs: Any) -> Any:
            calls.append(len(keys))
            return super().batch_put_from_multi_buffers(keys, *args, **kwargs)

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Counting)
    return calls


@contextlib.contextmanager
def raw_client(config: MooncakeConfig, **setup_keywords: Any) -> Iterator[MooncakeDistributedStore]:
    """A client on the raw binding, set up with `config` (asserted), closed on exit: to see or
    write what the store holds behind a cache's back."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup(*config.setup_args(), **setup_keywords) == 0
    try:
        yield client
    finally:
        client.close()
