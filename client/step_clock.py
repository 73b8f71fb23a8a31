"""When the runtime should form its next pipelined step: behind a long step, just before that step ends.

A step formed as soon as the one before it is submitted carries only what arrived before that moment, then waits
behind it on the device; what arrives while it waits goes into the step after, so under load a request waits
through the rest of the step in flight, the queued one and its own: about 2.5 steps on average (bench/LOG.md
section 41). Formed just before the step in flight ends, the next step carries everything that arrived while it
ran and still starts the moment it ends: 1.5 steps on average, whatever the load.

The clock learns how long steps take, per size (rows and symbols, each rounded up to a power of two, rows to a
row count the team client's steps run at where one lies between: a symbol's state costs a step more than a row does),
from when each one ended, and how long the host takes to form and submit one (the lead it must be formed by). A
step's device time is counted from when it could start: its submission, or the end of the step before it if that
came later.

The clock also says how many of the waiting requests a step should take (rows_to_take): a step of several requests
a symbol runs at the captured shape of its size's rows, so 280 rows ran at 512's shape before the engine had one of
384 (served on an H100 at K = 8, ~340 rows there took 22.2 ms, 256 rows 17.1-17.3; bench/LOG.md section 48). Taking
the oldest rows of the next smaller size and leaving the rest to the next step serves more requests a second when the
rows barely pass it. The rows left wait for the next step, about as long as this one would have taken: so the smaller
size is taken where the time it saves its rows, s (t_all - t_s), passes the step the rows left wait, (r - s) t_all;
where r / t_all and s / t_s barely differ, all of them. (The rule before, the size with more rows a second, took 128
of 185-196 waiting rows in 9.6 ms against 14.2 for all on an H200 at 16,000 req/s: 13,300 rows a second where 16,000
arrived, and the rows left went a step later; bench/LOG.md section 77.)

Behind a short step the next is formed at once, as before: little can arrive in what is left of a short step,
and a late one that misjudges the end leaves the GPU idle for the host's time. Measured on one H100 host, in turn
(bench/LOG.md section 41): at 400 req/s over 20 symbols (steps of 2.3-3 ms) forming late gave the same p50 and a
p99 1.8-3.5 ms longer in three pairs of runs out of three; over 64 symbols at 8,000 and 11,000 req/s (steps of 12-17
ms) p50 27-29% and p99 9-25% shorter. Measured again on three hosts (section 53): forming late behind every step, with
a margin of 0.8 ms, served the swap section's hot requests at p50 4.8 against 5.4 ms and p99 6.8-7.1 against 7.4-7.5
on quiet hosts, but the event's load at p99 23.4 / 23.8 against 16.9 / 16.8 ms on a host that stalled: the queued
step that forming at once keeps on the GPU is what carries the GPU through the host's stalls.

So a clock given punctual_late_after_s below late_after_s follows steps that long late only while the host wakes the
submitter on time: the runtime tells it how late each timed wait to form a step ended (woke), and one more than
late_wake_s late (a host's stall, not the timer's and the GIL's routine slack) puts it back on late_after_s for
hold_s. Off by default: measured on quiet H100 hosts it moved the swap's hot p50 -0.4 ms but its p99 +0.25 and the
event's load p99 not at all (bench.py --punctual-late-after-ms; bench/LOG.md section 55).
"""
import time

# Weight of the latest observation in the running averages (about the last 5 steps of a size count).
SMOOTHING = 0.2
# Formed this much earlier than the host's own time says: a thread's wake-up, the spread of step times.
MARGIN_S = 0.0003
# Steps shorter than this are followed at once (the event's load, 2.3-4.8 ms at 1-20 symbols, keeps the rule
# before; the steps of 64 symbols, 10 ms and more, are formed late).
LATE_AFTER_S = 0.006
# A timed wait that ends more than this after it was due counts as late: the stalls that cost the event's load its
# tail last milliseconds (bench/LOG.md sections 49-53), where a timer's slack and the GIL (runtime.SWITCH_INTERVAL_S,
# 0.2 ms) make a few tenths of a millisecond routine.
LATE_WAKE_S = 0.001
# After a late wake, how long a clock with punctual_late_after_s keeps to late_after_s: a host that stalls once
# stalls again within seconds (scripts/host_hiccups.py: 38-270 gaps over 0.5 ms in 5-15 s on such hosts).
PUNCTUAL_HOLD_S = 2.0


def step_size(rows: int, symbols: int, row_sizes=()) -> tuple[int, int]:
    """The size class of a step of `rows` requests over `symbols` symbols: each rounded up to a power of two, rows
    to the smallest of `row_sizes` (the rows the team client's steps run at, e.g. the engine's midpoint shape of 384
    rows between 256 and 512) that holds them short of that power."""
    power = 1 << max(rows - 1, 0).bit_length()
    rows_class = min((r for r in row_sizes if rows <= r < power), default=power)
    return rows_class, 1 << max(symbols - 1, 0).bit_length()


class StepClock:
    """Step times per size and the host's submit time, learned as steps end; not thread-safe (the runtime calls it
    under its lock)."""

    def __init__(self, smoothing: float = SMOOTHING, margin_s: float = MARGIN_S, late_after_s: float = LATE_AFTER_S,
                 clock=time.monotonic, row_sizes=(), punctual_late_after_s: float | None = None,
                 late_wake_s: float = LATE_WAKE_S, hold_s: float = PUNCTUAL_HOLD_S):
        """row_sizes: the rows the team client's steps run at (team_api.step_rows), refining the powers of two.
        punctual_late_after_s (<= late_after_s; default late_after_s): the threshold while the submitter has woken
        on time for hold_s."""
        punctual = late_after_s if punctual_late_after_s is None else punctual_late_after_s
        if not 0 < smoothing <= 1 or margin_s < 0 or late_after_s < 0 or not 0 <= punctual <= late_after_s \
                or late_wake_s < 0 or hold_s < 0:
            raise ValueError(f"need 0 < smoothing <= 1, margin_s >= 0, late_after_s >= 0, 0 <= "
                             f"punctual_late_after_s <= late_after_s, late_wake_s >= 0 and hold_s >= 0, got "
                             f"{smoothing!r}, {margin_s!r}, {late_after_s!r}, {punctual_late_after_s!r}, "
                             f"{late_wake_s!r} and {hold_s!r}")
        self.smoothing, self.margin_s, self.late_after_s, self.now = smoothing, margin_s, late_after_s, clock
        self.punctual_late_after_s, self.late_wake_s, self.hold_s = punctual, late_wake_s, hold_s
        self.late_wakes = 0  # timed waits that ended more than late_wake_s late
        self.latest_wake_s = 0.0  # the latest any timed wait ended
        self._late_wake_at: float | None = None  # when the latest late one ended
        self.row_sizes = tuple(sorted(row_sizes))
        self._step_s: dict[tuple, float] = {}  # step_size -> seconds a step of that size ran
        self._submit_s: float | None = None  # seconds from forming a step to its submit call returning
        self._last_end: float | None = None  # when the latest step ended

    def size(self, rows: int, symbols: int) -> tuple[int, int]:
        """step_size with this clock's row sizes."""
        return step_size(rows, symbols, self.row_sizes)

    def _average(self, old, new):
        return new if old is None else old + self.smoothing * (new - old)

    def submitted(self, formed_at: float, submitted_at: float) -> None:
        self._submit_s = self._average(self._submit_s, submitted_at - formed_at)

    def ended(self, size: tuple, submitted_at: float, ended_at: float) -> None:
        """A step of `size` (step_size) submitted at `submitted_at` ended (its answer came back) at `ended_at`; steps
        end in the order they were submitted."""
        started = submitted_at if self._last_end is None else max(submitted_at, self._last_end)
        self._step_s[size] = self._average(self._step_s.get(size), ended_at - started)
        self._last_end = ended_at

    def woke(self, late_by_s: float) -> None:
        """The submitter's timed wait to form a step (form_in's seconds) ended late_by_s after it was due."""
        self.latest_wake_s = max(self.latest_wake_s, late_by_s)
        if late_by_s > self.late_wake_s:
            self.late_wakes += 1
            self._late_wake_at = self.now()

    def late_after(self) -> float:
        """Steps at least this long are followed late: punctual_late_after_s while no wait has ended late for
        hold_s, late_after_s otherwise."""
        if self._late_wake_at is not None and self.now() - self._late_wake_at < self.hold_s:
            return self.late_after_s
        return self.punctual_late_after_s

    def rows_to_take(self, rows: int, symbols: int) -> int:
        """How many of `rows` waiting requests over `symbols` symbols the next step should take: all of them, or
        the next smaller size's rows when the time that saves them, against a step of all of them (padded to their
        size), is more than the rows left wait for the step after (taken as long as one of all of them). All of
        them until both sizes' step times are known, and for steps of one request a symbol: the engine pads those
        to its own buckets of symbols, whose state traffic sets their time, not to these sizes."""
        whole = self.size(rows, symbols)
        if rows <= symbols or rows == whole[0]:
            return rows
        # the next size down: the largest power of two or row size below this one (whole[0] // 2 only where this
        # one is a power of two: below a row size of 384 it is 256, not 192)
        smaller = max([1 << ((whole[0] - 1).bit_length() - 1), *(r for r in self.row_sizes if r < whole[0])])
        whole_s, smaller_s = self._step_s.get(whole), self._step_s.get(self.size(smaller, min(symbols, smaller)))
        if whole_s is None or smaller_s is None or smaller * (whole_s - smaller_s) <= (rows - smaller) * whole_s:
            return rows
        return smaller

    def form_in(self, size: tuple, submitted_at: float) -> float:
        """Seconds from now until the next step should be formed, while a step of `size` (step_size) submitted at
        `submitted_at` is the only one in flight: 0 when it is due, when such steps are short (under late_after()),
        or when nothing is known yet of steps that size."""
        step_s = self._step_s.get(size)
        if step_s is None or self._submit_s is None or step_s < self.late_after():
            return 0.0
        started = submitted_at if self._last_end is None else max(submitted_at, self._last_end)
        return max(0.0, started + step_s - self._submit_s - self.margin_s - self.now())
