"""scripts/benchmarks/awake_cpus.py: one lowest-priority spinner per CPU while the context is open, none after."""
import os
import time

import pytest

from scripts.benchmarks.awake_cpus import AwakeCpus

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux")


def _policy_and_cpus(pid):
    return os.sched_getscheduler(pid), os.sched_getaffinity(pid)


def test_a_spinner_at_the_idle_priority_on_each_cpu_and_none_left_after():
    cpus = sorted(os.sched_getaffinity(0))
    with AwakeCpus() as awake:
        pids = awake.pids
        assert len(pids) == len(cpus) and awake.alive() == len(cpus)
        deadline = time.monotonic() + 30
        while (seen := [_policy_and_cpus(pid) for pid in pids]) != [(os.SCHED_IDLE, {cpu}) for cpu in cpus]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
    assert awake.alive() == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_chosen_cpu_only():
    cpu = min(os.sched_getaffinity(0))
    with AwakeCpus([cpu]) as awake:
        assert awake.cpus == [cpu] and awake.alive() == 1
