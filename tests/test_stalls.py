"""client.stalls.StallProbe: collector runs, late wake-ups and event-loop lag are noted with their times."""
import asyncio
import gc
import os
import signal
import sys
import threading
import time

import pytest

from client.stalls import StallProbe, ThreadClock, host_steal_s


def test_collections_are_noted_with_their_generation_and_stop_detaches():
    probe = StallProbe().start()
    try:
        before = time.monotonic()
        gc.collect()
    finally:
        probe.stop()
    assert any(gen == 2 and start >= before and seconds >= 0 for start, seconds, gen in probe.collections)
    count = len(probe.collections)
    gc.collect()
    assert len(probe.collections) == count  # stopped: no longer a collector callback


def test_a_thread_kept_from_the_interpreter_wakes_late():
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # this thread keeps the GIL up to 50 ms while the probe's thread waits for it
    probe = StallProbe(tick_s=0.001, late_s=0.01).start()
    try:
        time.sleep(0.01)  # let the probe's thread start sleeping
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)
        probe.stop()
    assert probe.late_wakeups and max(event[1] for event in probe.late_wakeups) > 0.01


def test_a_blocked_event_loop_is_noted_as_lag():
    probe = StallProbe(tick_s=0.001, lag_s=0.02)

    async def main():
        watch = asyncio.create_task(probe.watch_loop())
        await asyncio.sleep(0.01)
        time.sleep(0.06)  # a coroutine that blocks the loop
        await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(main())
    assert len(probe.loop_lags) == 1 and probe.loop_lags[0][1] >= 0.04
    assert set(probe.events()) == {"collections", "late_wakeups", "loop_lags"}


@pytest.mark.skipif(ThreadClock().read() is None, reason="no /proc/thread-self/schedstat (not Linux)")
def test_a_loop_lag_says_whether_the_loop_was_busy_or_blocked():
    """The loop computing shows as time on a CPU (or waiting for one, on a busy host), the loop blocked in a call
    that sleeps as neither."""
    probe = StallProbe(tick_s=0.001, lag_s=0.03)

    async def main():
        watch = asyncio.create_task(probe.watch_loop())
        await asyncio.sleep(0.01)
        end = time.monotonic() + 0.1
        while time.monotonic() < end:  # busy
            pass
        await asyncio.sleep(0.01)
        time.sleep(0.1)  # blocked
        await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(main())
    busy, blocked = (event[2] for event in probe.loop_lags)
    assert busy["on_cpu_ms"] + busy["runnable_ms"] > 80 and busy["blocked_ms"] < 20
    assert blocked["blocked_ms"] > 80 and blocked["on_cpu_ms"] < 20


def test_a_thread_clock_without_schedstat_reads_nothing(monkeypatch):
    def no_file(*args):
        raise FileNotFoundError("/proc/thread-self/schedstat")

    monkeypatch.setattr(os, "open", no_file)
    clock = ThreadClock()
    assert clock.read() is None and clock.spent_since(None, 0.01, 0.005) is None
    clock.close()


def _block_the_loop_for(seconds):
    time.sleep(seconds)


def test_a_long_stall_writes_the_loops_stack_while_it_lasts(tmp_path):
    path = tmp_path / "stacks.txt"
    probe = StallProbe(tick_s=0.001, stacks_path=str(path), stacks_after_s=0.2)

    async def main():
        watch = asyncio.create_task(probe.watch_loop())
        await asyncio.sleep(0.3)  # ticks re-arm the watchdog: nothing written
        assert path.read_text() == ""
        _block_the_loop_for(0.8)
        await asyncio.sleep(0.01)
        watch.cancel()

    asyncio.run(main())
    probe.stop()
    stacks = path.read_text()
    assert "_block_the_loop_for" in stacks and "watch_loop" not in stacks  # taken while the loop was held
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_watch_cancelled_leaves_no_timer_to_write_a_stack_afterwards(tmp_path):
    """watch_loop stops when cancelled, but its timer, armed at its last tick, stayed armed (and the stacks file
    open) until stop(): the loop, idle and never held up, had its stack written as a stall once the timer fired."""
    path = tmp_path / "stacks.txt"
    probe = StallProbe(tick_s=0.001, stacks_path=str(path), stacks_after_s=0.05)

    async def main():
        watch = asyncio.create_task(probe.watch_loop())
        await asyncio.sleep(0.02)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        await asyncio.sleep(0.2)  # past the timer's time, the loop idle

    try:
        asyncio.run(main())
        assert path.read_text() == ""
    finally:
        probe.stop()
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_stacks_need_the_loop_in_the_main_thread(tmp_path):
    """The timer's signal is handled on the main thread, whose stack the handler writes: a loop elsewhere would
    get another thread's stack."""
    probe = StallProbe(stacks_path=str(tmp_path / "stacks.txt"))
    raised = []

    def elsewhere():
        try:
            asyncio.run(probe.watch_loop())
        except RuntimeError as exc:
            raised.append(str(exc))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert raised == ["a stall probe's stacks need its event loop in the main thread, where the timer's signal is "
                      "handled"]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_host_steal_is_the_hypervisors_cpu_time_or_none(monkeypatch):
    first = host_steal_s()
    if os.path.exists("/proc/stat"):
        assert first is not None and 0 <= first <= host_steal_s()

    def no_file(*args, **kwargs):
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr("builtins.open", no_file)
    assert host_steal_s() is None
