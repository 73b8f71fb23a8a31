"""An engine on a GPU other than GPU 0 makes no CUDA context on GPU 0, whichever thread calls it. A thread starts on
GPU 0, and a CUDA call there made a context on it: ~0.5 GiB of GPU 0's memory (another shard's, or another team's)
and ~0.1 s of a process shard's first step (bench/LOG.md section 74)."""
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

# In a fresh process: nothing before it has touched GPU 0.
ENGINES_ON_GPU_1 = r"""
import gc, threading, time, weakref
import numpy as np, torch
from client.engine import make_engine
from client.engine.fast import FastEngine
from client.engine.fast.state_table import StateTable
from client.model import load_model

def in_thread(call):
    out = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join()
    return out[0]

gpu = torch.device("cuda:1")
rng = np.random.default_rng(0)
rows = lambda n: rng.standard_normal((n, 79)).astype(np.float32)
load = lambda: load_model("tiny", seed=0, device=gpu)[0]
fast = FastEngine(load, gpu, capacity=2, host_symbols=4, progress=False)
fast.wait_pinned(progress=False)
fast.step(["A", "B"], rows(2))
in_thread(lambda: fast.step(["C", "D"], rows(2)))  # A and B to the host tier
in_thread(lambda: fast.prefetch(["A"]))
pending = fast.submit(["A", "A"], rows(2))
while not in_thread(pending.done):
    time.sleep(0.001)
in_thread(pending.result)
in_thread(lambda: fast.ready("B"))
in_thread(lambda: fast.release(["C"]))
with torch.cuda.device(gpu), torch.cuda.stream(fast.step_streams[0]):
    torch.cuda._sleep(100_000_000)  # ~50 ms: the next step queues behind one still running, so it takes joins
ahead = fast.submit(["A"], rows(1))
queued = fast.submit(["D"], rows(1), joinable=True)  # D back from the host tier, A out to it
assert hasattr(queued, "join")  # else the join below would test nothing
fast.prefetch(["A"])  # A's way back on record in its slot: a join of A asks that copy's event
in_thread(lambda: queued.join("A", rows(1)[0]))  # from a thread that made no CUDA call before
in_thread(queued.result)
in_thread(ahead.result)
def drop(held):
    held.clear()
    gc.collect()

held = [StateTable(({"s": ((4,), torch.float32, 0.0)}, gpu), 2, host_capacity=2)]
held[0].wait_pinned()
in_thread(lambda: drop(held))  # its host tier unregistered from a thread that made no CUDA call before
reference = make_engine("reference", load, device=gpu, capacity=4, host_symbols=0, progress=False)
in_thread(lambda: reference.step(["A", "B"], rows(2)))
from client.accuracy import ReferenceStepper  # the evaluator's and the bench's targets, as a CUDA graph
stepper = ReferenceStepper(load(), 2, gpu)
stepper.step(torch.zeros(2, 79, device=gpu))
torch.cuda.synchronize(gpu)
engines = [fast, reference, stepper]  # with their CUDA graphs, dropped in a thread that made no CUDA call before
collected = [weakref.ref(engine) for engine in engines]
del fast, reference, stepper, pending, queued, ahead
in_thread(lambda: drop(engines))
assert not any(ref() for ref in collected), "an engine outlived the drop: it tested nothing"
print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
"""


@two_gpus
def test_engines_on_gpu_1_leave_gpu_0_alone():
    done = subprocess.run([sys.executable, "-c", ENGINES_ON_GPU_1], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "True"]  # a context on GPU 1 alone


def _gpus_of(pid) -> set[str]:
    """The UUIDs (without nvidia-smi's "GPU-") of the GPUs on which nvidia-smi lists a context of process `pid`."""
    listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=60).stdout
    return {uuid.strip().removeprefix("GPU-") for line in listed.splitlines() if "," in line
            for owner, uuid in [line.split(",", 1)] if owner.strip() == str(pid)}


@two_gpus
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi (it lists each GPU's contexts)")
def test_process_shard_on_gpu_1_leaves_gpu_0_alone():
    from client.engine.shard_process import process_shards
    from client.engine.sharded import ModelSpec, ShardedEngine

    shards = process_shards(ModelSpec("tiny", seed=0), ["cuda:1"], options={"capacity": 4, "host_symbols": 2},
                            progress=False)
    with ShardedEngine(shards, progress=False, transport="process") as engine:
        rng = np.random.default_rng(0)
        for symbols in (["A"], ["B", "C", "B"], ["D", "E"], ["A"]):
            engine.step(symbols, rng.standard_normal((len(symbols), 79)).astype(np.float32))
        time.sleep(1)  # the host tier's pinning thread registers meanwhile
        uuids = [str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-") for i in (0, 1)]
        held = _gpus_of(shards[0].process.pid)
        if uuids[1] not in held:
            pytest.skip("nvidia-smi does not list this container's processes by their pids here")
        assert uuids[0] not in held
