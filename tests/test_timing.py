"""Injected heterogeneity: the sleep after each step, against the step times it must produce."""

from types import SimpleNamespace

import pytest

from diloco.timing import InjectedPace


def train(slowdown=2.0, step_seconds=0.0):
    return SimpleNamespace(slowdown=slowdown, step_seconds=step_seconds)


@pytest.mark.parametrize("busy", [0.01, 0.1, 0.24])
def test_an_emulated_step_takes_step_seconds_and_a_slow_shards_slowdown_times_that(busy):
    fast, slow = (
        InjectedPace(train(step_seconds=0.25), slow=False),
        InjectedPace(train(step_seconds=0.25), slow=True),
    )
    assert busy + fast.rest(busy) == pytest.approx(0.25)
    assert busy + slow.rest(busy) == pytest.approx(0.5)
    assert fast.summary() == {"emulated_step": {"seconds": 0.25, "steps": 1, "steps_over": 0}}


def test_work_longer_than_the_emulated_step_is_not_slept_on_and_is_counted():
    pace = InjectedPace(train(step_seconds=0.25), slow=False)
    rests = [pace.rest(busy) for busy in (0.1, 0.3, 0.2, 0.26)]
    assert rests == pytest.approx([0.15, 0.0, 0.05, 0.0])
    assert pace.summary()["emulated_step"] == {"seconds": 0.25, "steps": 4, "steps_over": 2}


def test_without_an_emulated_step_only_a_slow_shard_sleeps_its_slowdown_on_its_work():
    slow, fast = InjectedPace(train(slowdown=2.5), slow=True), InjectedPace(train(slowdown=2.5), slow=False)
    assert 0.2 + slow.rest(0.2) == pytest.approx(2.5 * 0.2)
    assert fast.rest(0.2) == 0.0
    assert slow.summary() == fast.summary() == {}


def test_the_training_loop_paces_only_when_something_is_injected():
    assert not InjectedPace(train(slowdown=1.0), slow=True).active
    assert not InjectedPace(train(slowdown=2.0), slow=False).active
    assert InjectedPace(train(slowdown=2.0), slow=True).active
    assert InjectedPace(train(slowdown=1.0, step_seconds=0.25), slow=False).active
