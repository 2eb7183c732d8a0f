"""Key text of a batch: read once per key object, the type checked once per batch when it can be."""

from __future__ import annotations

import threading

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, Modality, mm_hash
from mmkey._deadline import Call, CallTimeout, DeadlineRunner
from mmkey.cache._guard import key_texts
from mmkey.testing.strategies import embedding_keys


def keys(n: int) -> list[EmbeddingKey]:
    return EmbeddingKey.for_digests(
        "texts", Modality.IMAGE, HashScheme.BLAKE3, [mm_hash(i) for i in range(n)]
    )


@attrs.frozen(slots=True)
class Renamed(EmbeddingKey):
    """A subclass with text of its own: its `to_key` must win over the cached text."""

    def to_key(self) -> str:
        return "renamed-" + super().to_key()


class Foreign:
    """A foreign `CacheKey` that happens to carry a `_text` attribute."""

    _text = "not-this"

    def to_key(self) -> str:
        return "foreign-key"


def test_a_batch_of_embedding_keys_gives_their_texts_in_order() -> None:
    batch = keys(50)
    assert key_texts(batch, "m") == [k.to_key() for k in batch]
    assert key_texts(tuple(batch), "m") == [k.to_key() for k in batch]
    assert key_texts([], "m") == []


@given(st.lists(embedding_keys(), max_size=20), st.booleans())
def test_batch_texts_are_each_keys_own_text(batch: list[EmbeddingKey], as_tuple: bool) -> None:
    keys_in: list[EmbeddingKey] | tuple[EmbeddingKey, ...] = tuple(batch) if as_tuple else batch
    assert key_texts(keys_in, "m") == [EmbeddingKey.from_key(k.to_key()).to_key() for k in batch]


def test_keys_of_other_types_in_a_batch_are_checked_one_by_one() -> None:
    batch: list[object] = [
        *keys(3),
        Renamed("texts", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(7)),
        Foreign(),
    ]
    texts = key_texts(batch, "m")  # type: ignore[arg-type]
    assert texts[3].startswith("renamed-mmk1@") and texts[4] == "foreign-key"
    with pytest.raises(TypeError, match="CacheKey"):
        key_texts([*keys(2), 5], "m")  # type: ignore[list-item]


def test_a_call_settles_once_and_runs_its_callbacks() -> None:
    runner = DeadlineRunner("test")
    release, started = threading.Event(), threading.Event()
    seen: list[object] = []

    def hold() -> str:
        started.set()
        release.wait(10)
        return "ran"

    running = runner.submit(hold)
    assert started.wait(5)
    queued = runner.submit(lambda: "never")
    queued.add_done_callback(lambda c: seen.append(("queued", c.cancelled())))
    assert queued.cancel() and queued.cancelled() and queued.done()
    with pytest.raises(CallTimeout):
        queued.result(0)
    called_back = threading.Event()

    def on_done(c: Call[str]) -> None:
        seen.append(("running", c.result()))
        called_back.set()

    running.add_done_callback(on_done)
    assert not running.cancel(), "a running call cannot be cancelled"
    assert not running.wait(0.01)
    release.set()
    assert running.result(5) == "ran" and running.exception() is None
    # the worker wakes waiters first and runs the callbacks right after, on its own thread
    assert called_back.wait(5)
    running.add_done_callback(lambda c: seen.append(("late", c.result())))  # at once
    assert seen == [("queued", True), ("running", "ran"), ("late", "ran")]
    failing = runner.submit(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert isinstance(failing.exception(), ZeroDivisionError)
    runner.stop()
    assert runner.join(5)
