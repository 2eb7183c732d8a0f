"""The SGLang store's memory of recent yes answers (no SGLang needed): what it remembers,
what it forgets, for how long, and how much; the store's side is in test_sglang_store.py."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from mmkey.integrations.sglang._recent import RecentlyPresent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_yes_is_remembered_for_its_hold_and_no_forgets_at_once() -> None:
    clock = Clock()
    recent = RecentlyPresent(1.0, 100, clock=clock)
    recent.note(["a", "b", "c"], [True, True, False])
    assert recent.all_present(["a", "b"]) and recent.all_present(["b", "a", "a"])
    assert not recent.all_present(["a", "c"])
    recent.note(["b"], [False])
    assert not recent.all_present(["a", "b"]) and recent.all_present(["a"])
    clock.now += 0.99
    assert recent.all_present(["a"])
    clock.now += 0.02
    assert not recent.all_present(["a"])
    recent.note(["a"], [True])  # a new yes starts a new hold
    assert recent.all_present(["a"])


def test_what_is_never_answered_from_memory() -> None:
    recent = RecentlyPresent(1.0, 100)
    recent.note(["a"], [True])
    assert recent.all_present(["a"])
    assert not recent.all_present([])
    assert not recent.all_present(("a",))  # not SGLang's list: the store's path answers
    assert not recent.all_present(None)
    assert not recent.all_present(["a", ["a"]])  # unhashable: the store's path refuses it
    recent.note(["x", ["y"]], [False, False])  # type: ignore[list-item]  # forgetting never raises
    recent.clear()  # a store fault
    assert not recent.all_present(["a"])
    recent.note(["a"], [True])
    recent.close()
    recent.note(["a"], [True])
    assert not recent.all_present(["a"]) and len(recent) == 0


def test_it_holds_at_most_its_limit_forgetting_the_older_answers_first() -> None:
    clock = Clock()
    recent = RecentlyPresent(1.0, 3, clock=clock)
    recent.note(["a", "b"], [True, True])
    clock.now += 0.6  # a and b are now the older generation
    recent.note(["c", "d"], [True, True])
    assert len(recent) == 2 and recent.all_present(["c", "d"]) and not recent.all_present(["a"])
    recent.note(["e", "f"], [True, True])
    assert len(recent) <= 3
    recent.note(["g"], [True])
    assert recent.all_present(["g"])


def test_a_yes_lasts_between_half_the_hold_and_the_hold() -> None:
    clock = Clock()
    recent = RecentlyPresent(1.0, 100, clock=clock)
    recent.note(["a"], [True])
    clock.now += 0.3
    recent.note(["b"], [True])
    clock.now += 0.3  # a new generation starts with the next update
    recent.note(["c"], [True])
    assert recent.all_present(["a", "b", "c"])  # across both generations
    clock.now += 0.5
    assert not recent.all_present(["a"]) and not recent.all_present(["b"])  # 1.1 and 0.8 s old
    assert recent.all_present(["c"])  # 0.5 s old
    clock.now += 0.5
    assert not recent.all_present(["c"])  # a whole hold


@given(
    st.lists(st.tuples(st.sampled_from("abcd"), st.booleans()), max_size=20),
    st.lists(st.sampled_from("abcd"), max_size=4),
)
@example([("a", True), ("a", False)], ["a"])
@example([("a", False), ("a", True)], ["a"])
def test_answers_follow_the_last_answer_of_each_hash(
    answers: list[tuple[str, bool]], asked: list[str]
) -> None:
    recent = RecentlyPresent(1.0, 100, clock=lambda: 0.0)
    last: dict[str, bool] = {}
    for text, yes in answers:
        recent.note([text], [yes])
        last[text] = yes
    assert recent.all_present(asked) == (bool(asked) and all(last.get(t, False) for t in asked))


def test_an_update_after_a_whole_hold_without_updates_forgets_every_earlier_yes() -> None:
    """Past a whole hold the young generation is not kept as the old one: it is too old."""
    clock = Clock()
    recent = RecentlyPresent(1.0, 100, clock=clock)
    recent.note(["a"], [True])
    clock.now += 1.2
    recent.note(["b"], [True])
    assert not recent.all_present(["a"]) and recent.all_present(["b"])
    assert len(recent) == 1
