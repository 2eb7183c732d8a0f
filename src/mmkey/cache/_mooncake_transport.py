"""The transport under `MooncakeCache`: the store's set-up and close, the worker, deadlines, breaker.

Every binding call runs on a worker thread (a lane) and the caller waits at most until its
call's give-up time. Mooncake's ``setup()`` and ``close()`` hold the GIL, so while they run
every thread of the process stops; neither is called unless the master has just answered
a request on its RPC port (`master_answers`), on the worker, right before the call. A store
that cannot be closed that way (the master does not answer, or the worker is still stuck in
a call when `close` gives up) is abandoned: never closed, never freed, its segment and
threads left to the process's exit, so that no thread ever freezes behind it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mmkey._net import parse_host_port
from mmkey.cache._master_ping import master_answers
from mmkey.cache._mooncake_staging import Staging
from mmkey.cache._runner import Breaker, CallTimeout, DeadlineRunner
from mmkey.cache.mooncake_config import MooncakeConfig
from mmkey.errors import StoreClosed, StoreError

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

__all__ = ["StoreTransport"]

T = TypeVar("T")

MAX_STAGING = 256 << 20
"""Largest registered staging buffer; larger entries get a buffer of their own."""
_PING_S = 1.0
"""The longest a liveness probe waits for the master (less when the call's time is short)."""
_CLOSE_S = 30.0
"""How long `close` waits for the binding's close once it began (it takes 1-2 s)."""


def _abandon(*objects: object) -> None:
    """Keep `objects` alive for good: a store that is never closed nor destroyed (its
    destructor would close it holding the GIL), and the buffers registered with it."""
    import ctypes

    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class StoreTransport:
    """One Mooncake store reached through a worker lane, within deadlines, behind a breaker.

    `call` runs a function of the store on the worker and returns its result, or ``None``
    (after reporting the failure through `on_error`) when the store is unreachable, the
    breaker is open, the worker is stuck, the call's time ran out, or the cache closed.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        store_class: type[MooncakeDistributedStore],
        on_error: Callable[[], None],
    ) -> None:
        self._config = config
        self.store_class = store_class
        self._on_error = on_error
        self._host, self._port = parse_host_port(config.master_server_address)
        self._lane = DeadlineRunner("mmkey-mooncake")
        self._breaker = Breaker(config.retry_after)
        self.staging = Staging(min(config.local_buffer_size, MAX_STAGING))
        self._store: MooncakeDistributedStore | None = None  # set and cleared on the lane only
        self._closed = False
        self._suspect = False  # a call failed: the master must answer before the next one
        self._lock = threading.Lock()
        self._closing = "pending"
        """How `close` ends, decided once under the lock: "close" (the binding's close runs,
        and `close` waits for it) or "abandon" (the caller stopped waiting first)."""

    def is_connected(self) -> bool:
        """Whether the store is set up and the last call to it succeeded."""
        return self._store is not None and not self._breaker.is_open()

    def master_answers(self, timeout: float) -> bool:
        """Whether the master replies to a request on its RPC port within `timeout` s."""
        return master_answers(self._host, self._port, timeout)

    def connect(self, give_up: float) -> bool:
        """Set the store up if the master answers; False (counted) if not by `give_up`.

        A set-up still running then finishes on the worker, and a later call finds it done.
        """
        try:
            ok = self._lane.call(
                functools.partial(self._setup_on_lane, give_up), give_up - time.monotonic()
            )
        except (CallTimeout, StoreClosed):
            ok = False
        if not ok:
            self.fail()
        return ok

    def call(
        self,
        fn: Callable[[MooncakeDistributedStore], T],
        give_up: float,
        abandoned: Callable[[T], object] | None = None,
    ) -> T | None:
        """`fn(store)` on the worker, waited for until `give_up` (a monotonic time).

        ``None`` when it failed (counted): store errors and timeouts also open the breaker;
        other exceptions of `fn` (an allocation failure) are only counted. `abandoned`
        receives the result of a call whose caller stopped waiting, to release it.
        """
        if self._closed:
            return None
        if self._lane.is_stuck(self._config.deadline) or not self._breaker.allow():
            self._on_error()
            return None
        if self._store is None:
            if not self.connect(give_up):
                return None
        elif self._suspect and not self.master_answers(min(give_up - time.monotonic(), 0.2)):
            self.fail()
            return None
        try:
            result = self._lane.call(
                functools.partial(self._run_on_lane, fn), give_up - time.monotonic(), abandoned
            )
        except StoreClosed:
            return None
        except StoreError:
            self.fail()
            return None
        except Exception:  # not a store fault (e.g. MemoryError for a huge foreign value)
            self._on_error()
            return None
        self._breaker.success()
        self._suspect = False
        return result

    def fail(self) -> None:
        """A store call failed: open the breaker and probe the master before the next call."""
        self._breaker.failure()
        self._suspect = True
        self._on_error()

    def close(self) -> None:
        """Close the store, waiting at most ``config.deadline``; callers waiting are released.

        The binding's close runs only if the master answers right before it; otherwise, or
        if the worker is still stuck in a call after the deadline, the store is abandoned.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        give_up = time.monotonic() + self._config.deadline
        done = self._lane.submit(functools.partial(self._close_on_lane, give_up))
        self._lane.close()
        try:
            done.result(timeout=max(give_up - time.monotonic(), 0.0))
            return
        except Exception:
            with self._lock:
                if self._closing == "pending":  # stuck: the worker abandons it when it returns
                    self._closing = "abandon"
        if self._closing == "close":  # the binding's close has begun: it ends with it
            with contextlib.suppress(Exception):
                done.result(timeout=_CLOSE_S)

    # -- on the worker ----------------------------------------------------------------------

    def _run_on_lane(self, fn: Callable[[MooncakeDistributedStore], T]) -> T:
        store = self._store
        if store is None or self._closed:
            raise StoreClosed("store closed")
        return fn(store)

    def _setup_on_lane(self, give_up: float) -> bool:
        if self._closed:
            return False
        if self._store is not None:
            return True
        left = give_up - time.monotonic()
        if left <= 0 or not self.master_answers(min(left, _PING_S)):
            return False
        store = self.store_class()
        if store.setup(*self._config.setup_args(), tenant_id=self._config.tenant_id) != 0:
            store.close()  # measured safe and quick on a store whose setup failed
            return False
        self._store = store
        return True

    def _close_on_lane(self, give_up: float) -> None:
        store, self._store = self._store, None
        if store is None:
            return
        left = give_up - time.monotonic()
        answered = left > 0 and self.master_answers(min(left, _PING_S))
        with self._lock:
            if not answered or self._closing == "abandon":
                self._closing = "abandon"
                _abandon(store, self.staging.detach())
                return
            self._closing = "close"
        self.staging.unregister(store)
        store.close()
