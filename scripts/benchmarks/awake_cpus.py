"""The host's CPUs kept out of idle: one spinning process per CPU at the lowest priority Linux has (SCHED_IDLE).

A thread woken on an idle CPU of a virtual machine waits until the hypervisor runs that CPU again; the spinner keeps
it running, and gives way at once to any other thread that wants the CPU (a SCHED_IDLE task is preempted by every
wake-up), so it takes no time from the client, the server or the driver. It costs the CPUs' idle time (power, and a
host's other tenants). bench/LOG.md section 50 measures it beside the e2e section's tail.
"""
import os
import subprocess
import sys

# Each spinner checks every ~20 ms that the process which started it is alive, so none outlives it.
_SPIN = """
import os, sys
cpu, parent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


class AwakeCpus:
    """Context manager: a SCHED_IDLE spinner on each of `cpus` (default: every CPU this process may use)."""

    def __init__(self, cpus=None):
        if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getaffinity"):
            raise RuntimeError("keeping CPUs awake needs Linux (SCHED_IDLE and CPU affinity)")
        self.cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self._spinners: list[subprocess.Popen] = []

    def __enter__(self):
        parent = str(os.getpid())
        try:
            for cpu in self.cpus:
                self._spinners.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), parent],
                                                       stdin=subprocess.DEVNULL))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for spinner in self._spinners:
            spinner.kill()
        for spinner in self._spinners:
            spinner.wait()
        self._spinners.clear()

    @property
    def pids(self) -> list[int]:
        return [spinner.pid for spinner in self._spinners]

    def alive(self) -> int:
        """Spinners still running (one per CPU unless one failed to start its priority or affinity)."""
        return sum(spinner.poll() is None for spinner in self._spinners)
