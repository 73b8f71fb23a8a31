"""What stalls a process: the garbage collector's runs, a sleeping thread woken late, an event loop held up.

Each is noted as (start on time.monotonic(), duration s[, detail]), so that a slow answer can be matched with
what happened around it in the client's and the server's process (scripts/e2e_timeline.py). On Linux a late
wake-up's or a loop lag's detail says how the late thread spent the interval (the kernel's schedstat of that
thread): on a CPU (the loop busy), runnable but waiting for a CPU (the host's CPUs taken), or blocked beyond its
sleep (the GIL, a lock, a page fault, or a CPU the hypervisor took: bench/LOG.md section 69). With a stacks file,
an event loop held up longer than stacks_after_s has its stack written there while it is held up: each tick
re-arms a real-time timer (setitimer, ~1 us; faulthandler.dump_traceback_later starts a thread each time, 0.29 ms
on a 2-core CPU box) whose SIGALRM faulthandler's C handler answers with the dump, needing no GIL, so what held the
loop shows even when a C call kept the GIL. The process's SIGALRM is the probe's while it watches.

The loop must run in the main thread: Linux hands a process's signal to its main thread unless that thread blocks
it, and the handler writes the stack of the thread it runs on. Not every thread's: reading other threads' frames
while they run, as a signal handler must, can crash the process (a bench run died of a segfault in the middle of
such a dump; bench/LOG.md section 65).
"""
import asyncio
import faulthandler
import gc
import os
import signal
import threading
import time


class StallProbe:
    """Notes collector runs, wake-ups of a thread sleeping `tick_s` that come more than `late_s` late (the
    process or its CPU was held up), and event-loop lag above `lag_s` once watch_loop() runs on a loop."""

    # The probe's own wake-ups cost the process latency: every 1 ms they added ~0.3 ms to the p50 at 400 req/s
    # (bench/LOG.md section 27); every 5 ms still catches every longer stall and most of a few ms.
    def __init__(self, tick_s: float = 0.005, late_s: float = 0.002, lag_s: float = 0.003,
                 stacks_path: str | None = None, stacks_after_s: float = 0.012):
        self.tick_s, self.late_s, self.lag_s = tick_s, late_s, lag_s
        self.stacks_path, self.stacks_after_s = stacks_path, stacks_after_s
        self._stacks_file = None
        self.collections: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self.late_wakeups: list[tuple[float, float]] = []      # (went to sleep, seconds beyond tick_s)
        self.loop_lags: list[tuple[float, float]] = []         # (went to sleep, seconds beyond tick_s)
        self._gc_start = None
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "StallProbe":
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="stall-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop_stacks()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _stop_stacks(self):
        """Disarm the loop's timer (first: its signal unhandled would end the process), then close the stacks."""
        if self._stacks_file is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.unregister(signal.SIGALRM)
            self._stacks_file.close()
            self._stacks_file = None

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.monotonic()
        elif self._gc_start is not None:
            self.collections.append((self._gc_start, time.monotonic() - self._gc_start, info["generation"]))

    def _watch(self):
        clock = ThreadClock()
        try:
            while not self._stop.is_set():
                start, asleep = clock.read(), time.monotonic()
                time.sleep(self.tick_s)
                self._note_late(self.late_wakeups, self.late_s, clock, start, asleep)
        finally:
            clock.close()

    async def watch_loop(self):
        """Run as a task on the event loop to watch; cancel it to stop."""
        if self.stacks_path is not None:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("a stall probe's stacks need its event loop in the main thread, where the "
                                   "timer's signal is handled")
            self._stacks_file = open(self.stacks_path, "a")
            faulthandler.register(signal.SIGALRM, file=self._stacks_file, all_threads=False)
        clock = ThreadClock()
        try:
            while True:
                if self._stacks_file is not None:  # re-armed each tick: it fires only if the loop misses the next ones
                    signal.setitimer(signal.ITIMER_REAL, self.stacks_after_s)
                start, asleep = clock.read(), time.monotonic()
                await asyncio.sleep(self.tick_s)
                self._note_late(self.loop_lags, self.lag_s, clock, start, asleep)
        finally:
            # a watch cancelled leaves no timer armed: it would write the stack of a loop no longer watched
            self._stop_stacks()
            clock.close()

    def _note_late(self, events, limit_s, clock, start, asleep):
        """Note a sleep of tick_s begun at `asleep` (the clock read at `start`) that ended over limit_s late."""
        beyond = time.monotonic() - asleep - self.tick_s
        if beyond > limit_s:
            events.append(_event(asleep, beyond, clock.spent_since(start, self.tick_s + beyond, self.tick_s)))

    def events(self) -> dict:
        return {"collections": list(self.collections), "late_wakeups": list(self.late_wakeups),
                "loop_lags": list(self.loop_lags)}


class ThreadClock:
    """The calling thread's time on a CPU and waiting for one (runnable, not running), from Linux's
    /proc/thread-self/schedstat (nanoseconds since the thread started); read() is None where there is none."""

    def __init__(self):
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[int, int] | None:
        if self._fd is None:
            return None
        on_cpu, runnable, _ = os.pread(self._fd, 128, 0).split()  # ~3 us: cheap enough for every tick
        return int(on_cpu), int(runnable)

    def spent_since(self, start, interval_s, asleep_s) -> dict | None:
        """How the thread spent the interval_s since `start` (a read()), in which it meant to sleep asleep_s:
        milliseconds on a CPU, waiting for a CPU, and blocked beyond its sleep (neither: the GIL, a lock, a page
        fault, or its CPU taken by the hypervisor, which a guest's kernel counts as no time of the thread's)."""
        now = self.read()
        if start is None or now is None:
            return None
        on_cpu, runnable = ((b - a) / 1e6 for a, b in zip(start, now))
        return {"on_cpu_ms": on_cpu, "runnable_ms": runnable,
                "blocked_ms": max(1e3 * (interval_s - asleep_s) - on_cpu - runnable, 0.0)}

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def host_steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this host's CPUs since boot, all CPUs together (/proc/stat's
    steal); None where there is none to read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _event(start, seconds, detail):
    return (start, seconds) if detail is None else (start, seconds, detail)
