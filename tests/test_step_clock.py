"""client/step_clock.py: when the next pipelined step is formed, from the step times it has seen."""
import pytest

from client.step_clock import StepClock, step_size


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_step_sizes_are_rows_and_symbols_rounded_up_to_powers_of_two():
    assert [step_size(n, 1)[0] for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    assert step_size(256, 64) == (256, 64) and step_size(64, 16) == (64, 16) and step_size(64, 33) == (64, 64)


def test_row_sizes_refine_the_powers_of_two():
    sizes = (8, 16, 32, 64, 128, 256, 384, 512)  # the engine's several-rows shapes at K = 8 over 64 symbols
    assert [step_size(n, 64, sizes)[0] for n in (200, 256, 257, 384, 385, 512)] == [256, 256, 384, 384, 512, 512]
    assert [step_size(n, n, sizes)[0] for n in (1, 3, 5, 20)] == [1, 4, 8, 32]  # one row a symbol: as before
    assert StepClock(row_sizes=sizes).size(300, 64) == (384, 64)


def test_rows_to_take_weighs_the_next_size_down():
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=FakeTime(), row_sizes=(256, 384, 512))
    clock.ended(clock.size(256, 64), submitted_at=0.0, ended_at=0.0172)   # 256 rows: 17.2 ms
    clock.ended(clock.size(384, 64), submitted_at=0.0172, ended_at=0.037)  # 384 rows: 19.8 ms
    clock.ended(clock.size(512, 64), submitted_at=0.037, ended_at=0.061)   # 512 rows: 24 ms
    assert clock.rows_to_take(270, 64) == 256  # 256 in 17.2 ms beat 270 in 19.8
    assert clock.rows_to_take(340, 64) == 340  # 340 in 19.8 beat 256 in 17.2
    assert clock.rows_to_take(400, 64) == 384  # 384 in 19.8 beat 400 in 24: the smaller is the midpoint
    assert clock.rows_to_take(500, 64) == 500


# step sizes of the tests below
ONE, FOUR, EIGHT, WIDE = step_size(1, 1), step_size(4, 2), step_size(8, 8), step_size(64, 64)


def test_nothing_known_forms_at_once():
    now = FakeTime()
    clock = StepClock(clock=now)
    assert clock.form_in(FOUR, submitted_at=0.0) == 0.0
    clock.submitted(0.0, 0.001)
    assert clock.form_in(FOUR, submitted_at=0.0) == 0.0  # no step of 4 rows has ended yet
    clock.ended(FOUR, submitted_at=0.001, ended_at=0.011)
    assert clock.form_in(WIDE, submitted_at=0.02) == 0.0  # nor of 64 symbols


def test_forms_the_host_time_and_margin_before_the_step_in_flight_ends():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0005, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.001)           # 1 ms from forming to submitted
    clock.ended(step_size(3, 2), submitted_at=0.001, ended_at=0.011)  # 10 ms a step of 3 rows (4, 2)
    # a step of 4 rows submitted at 20 ms, the device idle: it ends at 30 ms; form at 30 - 1 - 0.5 ms
    now.t = 0.021
    assert clock.form_in(FOUR, submitted_at=0.020) == pytest.approx(0.0075)
    now.t = 0.029
    assert clock.form_in(FOUR, submitted_at=0.020) == 0.0


def test_a_step_queued_behind_another_counts_from_the_end_of_that_one():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(ONE, submitted_at=0.0, ended_at=0.010)     # 10 ms
    # the next was submitted at 5 ms, behind the first: it ran from 10 to 20 ms, not 15 ms
    clock.ended(ONE, submitted_at=0.005, ended_at=0.020)
    now.t = 0.020
    assert clock.form_in(ONE, submitted_at=0.012) == pytest.approx(0.010)  # in flight since the end at 20 ms


def test_step_times_are_averaged():
    now = FakeTime()
    clock = StepClock(smoothing=0.5, margin_s=0.0, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(EIGHT, submitted_at=0.0, ended_at=0.010)
    clock.ended(EIGHT, submitted_at=0.010, ended_at=0.030)  # 20 ms: the average moves half way, to 15
    now.t = 0.030
    assert clock.form_in(EIGHT, submitted_at=0.030) == pytest.approx(0.015)


def test_behind_a_short_step_the_next_is_formed_at_once():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.006, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(ONE, submitted_at=0.0, ended_at=0.003)    # 3 ms: short
    clock.ended(WIDE, submitted_at=0.003, ended_at=0.013)  # 10 ms: long
    now.t = 0.013
    assert clock.form_in(ONE, submitted_at=0.013) == 0.0
    assert clock.form_in(WIDE, submitted_at=0.013) == pytest.approx(0.010)


def test_short_steps_are_followed_late_while_the_submitter_wakes_on_time():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0003, late_after_s=0.006, punctual_late_after_s=0.0, hold_s=2.0,
                      clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(ONE, submitted_at=0.0, ended_at=0.003)  # 3 ms: short, but the host has not been late yet
    now.t = 0.003
    assert clock.form_in(ONE, submitted_at=0.003) == pytest.approx(0.0027)
    clock.woke(0.0008)  # a timer's and the GIL's slack: still punctual
    assert clock.late_wakes == 0 and clock.form_in(ONE, submitted_at=0.003) > 0
    clock.woke(0.0011)  # a host's stall: short steps are formed at once for 2 s
    assert clock.late_wakes == 1 and clock.latest_wake_s == 0.0011 and clock.late_after() == 0.006
    now.t = 1.9
    assert clock.form_in(ONE, submitted_at=1.9) == 0.0
    now.t = 2.003
    assert clock.late_after() == 0.0 and clock.form_in(ONE, submitted_at=2.003) == pytest.approx(0.0027)


def test_without_punctual_late_after_the_rule_never_moves():
    clock = StepClock(margin_s=0.0003, late_after_s=0.006)
    assert clock.late_after() == 0.006
    clock.woke(0.01)
    assert clock.late_wakes == 1 and clock.late_after() == 0.006


def test_steps_of_as_many_rows_over_fewer_symbols_are_timed_apart():
    now = FakeTime()
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=now)
    clock.submitted(0.0, 0.0)
    clock.ended(step_size(64, 16), submitted_at=0.0, ended_at=0.006)    # 16 symbols x 4: 6 ms
    clock.ended(step_size(64, 64), submitted_at=0.006, ended_at=0.016)  # 64 symbols x 1: 10 ms
    now.t = 0.016
    assert clock.form_in(step_size(60, 15), submitted_at=0.016) == pytest.approx(0.006)
    assert clock.form_in(step_size(60, 60), submitted_at=0.016) == pytest.approx(0.010)


def test_a_step_takes_the_smaller_size_when_it_carries_more_requests_a_second():
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=FakeTime())
    assert clock.rows_to_take(280, 64) == 280  # nothing known yet: all of them
    clock.submitted(0.0, 0.0)
    clock.ended(step_size(256, 64), submitted_at=0.0, ended_at=0.0163)      # 256 rows: 16.3 ms
    assert clock.rows_to_take(280, 64) == 280  # 512 rows' time not known yet
    clock.ended(step_size(512, 64), submitted_at=0.0163, ended_at=0.0412)   # 512 rows: 24.9 ms
    # 256 rows 8.6 ms sooner than in 24.9 outweigh 24 (or 88) rows a step of 24.9 later; 134 rows do not
    assert clock.rows_to_take(280, 64) == 256 and clock.rows_to_take(340, 64) == 256
    assert clock.rows_to_take(390, 64) == 390 and clock.rows_to_take(400, 64) == 400
    assert clock.rows_to_take(256, 64) == 256 and clock.rows_to_take(512, 64) == 512  # no padding to save
    assert clock.rows_to_take(200, 64) == 200  # 128 rows' time not known


def test_rows_that_barely_pass_a_size_are_left_only_where_that_saves_time():
    """Served on an H200 at 16,000 req/s (bench/LOG.md section 77): 128 rows in 9.6 ms, 256 in 14.2. Of 170
    waiting rows, 128 carry more a second than all 170 (13,300 against 12,000), but go only 4.6 ms sooner where
    the 42 left would wait a step more: all of them. Of 150, only 22 wait: the 128."""
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=FakeTime())
    clock.submitted(0.0, 0.0)
    clock.ended(step_size(128, 64), submitted_at=0.0, ended_at=0.0096)
    clock.ended(step_size(256, 64), submitted_at=0.0096, ended_at=0.0238)
    assert clock.rows_to_take(190, 64) == 190 and clock.rows_to_take(170, 64) == 170
    assert clock.rows_to_take(150, 64) == 128


def test_the_smaller_size_is_timed_over_no_more_symbols_than_its_rows():
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=FakeTime())
    clock.submitted(0.0, 0.0)
    clock.ended(step_size(6, 6), submitted_at=0.0, ended_at=0.003)     # 8 rows over 8 symbols: 3 ms
    clock.ended(step_size(12, 6), submitted_at=0.003, ended_at=0.010)  # 16 rows over 8 symbols: 7 ms
    assert clock.rows_to_take(12, 6) == 8  # 8 rows in 3 ms beat 12 in 7: the smaller step's symbols are 8


def test_steps_of_one_request_a_symbol_take_them_all():
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=FakeTime())
    clock.submitted(0.0, 0.0)
    clock.ended(step_size(32, 32), submitted_at=0.0, ended_at=0.005)
    clock.ended(step_size(64, 64), submitted_at=0.005, ended_at=0.020)
    assert clock.rows_to_take(40, 40) == 40  # the engine runs 40 symbols at its own bucket, not 64's time


@pytest.mark.parametrize("smoothing, margin, late_after", [(0.0, 0.0, 0.0), (1.5, 0.0, 0.0), (0.5, -1.0, 0.0),
                                                           (0.5, 0.0, -1.0)])
def test_bad_settings(smoothing, margin, late_after):
    with pytest.raises(ValueError, match="smoothing"):
        StepClock(smoothing=smoothing, margin_s=margin, late_after_s=late_after)


@pytest.mark.parametrize("punctual, late_wake, hold", [(0.007, 0.001, 2.0), (-0.001, 0.001, 2.0),
                                                       (0.0, -0.001, 2.0), (0.0, 0.001, -1.0)])
def test_bad_punctual_settings(punctual, late_wake, hold):
    with pytest.raises(ValueError, match="punctual_late_after_s <= late_after_s"):
        StepClock(late_after_s=0.006, punctual_late_after_s=punctual, late_wake_s=late_wake, hold_s=hold)
