"""The claims an SGLang store won and has not ended (no SGLang needed): each ends at its put,
at its hold, over the limit or at close, and is given back once; the store's side, against a
real master, is in test_sglang_single_flight.py."""

from __future__ import annotations

import threading

from mmkey.digest import HashScheme, MMHash, Modality
from mmkey.integrations.sglang._claimed import WonClaims
from mmkey.keys import EmbeddingKey
from tests._support import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def key(n: int) -> EmbeddingKey:
    return EmbeddingKey("ns@1", Modality.IMAGE, HashScheme.SGLANG, MMHash(n))


class Released:
    """The keys given back, call by call."""

    def __init__(self) -> None:
        self.calls: list[list[EmbeddingKey]] = []
        self.lock = threading.Lock()

    def __call__(self, keys: list[EmbeddingKey]) -> None:
        with self.lock:
            self.calls.append(list(keys))

    def given(self) -> list[EmbeddingKey]:
        with self.lock:
            return [k for call in self.calls for k in call]


def test_a_put_ends_its_claims_once_and_ignores_hashes_it_does_not_hold() -> None:
    released = Released()
    won = WonClaims(released, 2.0, 100, clock=Clock(), sweep=False)
    won.add({"1": key(1), "2": key(2)})
    assert len(won) == 2 and "1" in won
    won.end(["1", "3", 7, None])  # SGLang's list: another hash, items that are not text
    assert released.calls == [[key(1)]]
    assert "1" not in won and "2" in won
    won.end(["1"])
    assert released.calls == [[key(1)]]  # given back once
    assert len(won) == 1


def test_a_claim_no_put_ends_is_given_back_at_its_hold_and_not_before() -> None:
    clock, released = Clock(), Released()
    won = WonClaims(released, 2.0, 100, clock=clock, sweep=False)
    won.add({"1": key(1)})
    clock.now += 1.0
    won.add({"2": key(2)})
    clock.now += 0.99
    assert won.expire() == 0 and released.calls == []
    clock.now += 0.01
    assert won.expire() == 1 and released.given() == [key(1)]  # the first, at 2.0 s
    clock.now += 1.0
    assert won.expire() == 1 and released.given() == [key(1), key(2)]
    assert len(won) == 0


def test_won_again_renews_the_hold() -> None:
    clock, released = Clock(), Released()
    won = WonClaims(released, 2.0, 100, clock=clock, sweep=False)
    won.add({"1": key(1)})
    clock.now += 1.5
    won.add({"1": key(1)})  # lapsed and won again meanwhile: held from now
    clock.now += 1.0
    assert won.expire() == 0
    clock.now += 1.0
    assert won.expire() == 1 and released.given() == [key(1)]


def test_over_the_limit_the_oldest_claims_are_given_back() -> None:
    released = Released()
    won = WonClaims(released, 2.0, 3, clock=Clock(), sweep=False)
    won.add({str(i): key(i) for i in range(3)})
    won.add({"3": key(3), "4": key(4)})
    assert released.given() == [key(0), key(1)]
    assert len(won) == 3 and all(str(i) in won for i in (2, 3, 4))


def test_close_gives_every_claim_back_and_holds_none_after() -> None:
    released = Released()
    won = WonClaims(released, 2.0, 100, clock=Clock(), sweep=False)
    won.add({"1": key(1), "2": key(2)})
    won.close()
    assert sorted(k.digest for k in released.given()) == [1, 2]
    won.add({"3": key(3)})  # a lookup racing the close: given back at once
    assert released.given()[-1] == key(3) and len(won) == 0


def test_the_sweeping_thread_gives_back_lapsed_claims_with_no_other_call() -> None:
    """Real time: nothing but the store's own thread ends a claim whose put never came."""
    released = Released()
    won = WonClaims(released, 0.05, 100)
    won.add({"1": key(1)})
    assert wait_until(lambda: released.given() == [key(1)], 10)
    assert len(won) == 0
    assert wait_until(lambda: won._thread is None, 10)  # no claim held: the thread ends
    won.add({"2": key(2)})  # and a new claim starts it again
    assert wait_until(lambda: released.given() == [key(1), key(2)], 10)
    won.close()


def test_one_sweeping_thread_however_many_adds_and_none_with_sweep_off() -> None:
    manual = WonClaims(Released(), 2.0, 100, clock=Clock(), sweep=False)
    manual.add({"1": key(1)})
    assert manual._thread is None, "sweep off: no thread"
    swept = WonClaims(Released(), 60.0, 100)
    try:
        swept.add({"1": key(1)})
        first = swept._thread
        assert first is not None and first.is_alive() and first.name == "mmkey-sglang-claims"
        swept.add({"2": key(2)})
        swept.add({"3": key(3)})
        assert swept._thread is first, "one thread for the store"
    finally:
        swept.close()
        manual.close()


def test_the_sweeping_thread_waits_for_the_oldest_hold_instead_of_spinning() -> None:
    released = Released()
    won = WonClaims(released, 0.3, 100)
    looks: list[int] = []
    expire = won.expire

    def counted() -> int:
        looks.append(1)
        return expire()

    won.expire = counted  # type: ignore[method-assign]
    try:
        won.add({"1": key(1)})
        assert won._thread is not None and won._thread.daemon, "never keeps the process alive"
        assert wait_until(lambda: released.given() == [key(1)], 10)
        assert len(looks) <= 3, f"the sweeper looked {len(looks)} times for one hold"
    finally:
        won.close()
