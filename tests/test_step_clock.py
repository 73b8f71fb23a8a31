"""client/step_clock.py: when the next pipelined step is formed, from the step times it has seen."""
import pytest

from client.step_clock import StepClock, size_class


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_size_classes_are_powers_of_two():
    assert [size_class(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]


def test_nothing_known_forms_at_once():
    now = FakeTime()
    clock = StepClock(clock=now)
    assert clock.form_in(4, submitted_at=0.0) == 0.0
    clock.submitted(0.0, 0.001)
    assert clock.form_in(4, submitted_at=0.0) == 0.0  # no step of 4 rows has ended yet
    clock.ended(4, submitted_at=0.001, ended_at=0.011)
    assert clock.form_in(64, submitted_at=0.02) == 0.0  # nor of 64


def test_forms_the_host_time_and_margin_before_the_step_in_flight_ends():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0005, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.001)           # 1 ms from forming to submitted
    clock.ended(3, submitted_at=0.001, ended_at=0.011)  # 10 ms a step of 3 (class 4)
    # a step of 4 rows submitted at 20 ms, the device idle: it ends at 30 ms; form at 30 - 1 - 0.5 ms
    now.t = 0.021
    assert clock.form_in(4, submitted_at=0.020) == pytest.approx(0.0075)
    now.t = 0.029
    assert clock.form_in(4, submitted_at=0.020) == 0.0


def test_a_step_queued_behind_another_counts_from_the_end_of_that_one():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(1, submitted_at=0.0, ended_at=0.010)     # 10 ms
    # the next was submitted at 5 ms, behind the first: it ran from 10 to 20 ms, not 15 ms
    clock.ended(1, submitted_at=0.005, ended_at=0.020)
    now.t = 0.020
    assert clock.form_in(1, submitted_at=0.012) == pytest.approx(0.010)  # in flight since the end at 20 ms


def test_step_times_are_averaged():
    now = FakeTime()
    clock = StepClock(smoothing=0.5, margin_s=0.0, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(8, submitted_at=0.0, ended_at=0.010)
    clock.ended(8, submitted_at=0.010, ended_at=0.030)  # 20 ms: the average moves half way, to 15
    now.t = 0.030
    assert clock.form_in(8, submitted_at=0.030) == pytest.approx(0.015)


def test_behind_a_short_step_the_next_is_formed_at_once():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.006, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(1, submitted_at=0.0, ended_at=0.003)    # 3 ms: short
    clock.ended(64, submitted_at=0.003, ended_at=0.013)  # 10 ms: long
    now.t = 0.013
    assert clock.form_in(1, submitted_at=0.013) == 0.0
    assert clock.form_in(64, submitted_at=0.013) == pytest.approx(0.010)


@pytest.mark.parametrize("smoothing, margin, late_after", [(0.0, 0.0, 0.0), (1.5, 0.0, 0.0), (0.5, -1.0, 0.0),
                                                           (0.5, 0.0, -1.0)])
def test_bad_settings(smoothing, margin, late_after):
    with pytest.raises(ValueError, match="smoothing"):
        StepClock(smoothing=smoothing, margin_s=margin, late_after_s=late_after)
