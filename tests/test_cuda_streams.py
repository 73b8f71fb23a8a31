"""client/engine/cuda_streams.py: an engine's CUDA streams are its own, never torch's pooled ones, which two engines in
one process shared (their graphs then shared cuBLAS workspaces: wrong predictions or a hung GPU)."""
import ctypes
import gc

import pytest
import torch

from client.engine import cuda_streams
from client.engine.cuda_streams import own_stream

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_library_lookup_finds_what_this_process_maps_and_nothing_else():
    assert cuda_streams._mapped("libtorch_cpu.so").endswith("/libtorch_cpu.so")
    assert cuda_streams._mapped("libno_such_library.so") is None


@cuda
def test_own_streams_are_distinct_non_blocking_and_never_from_torchs_pool():
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(70)}  # every pool, wrapped
    own = [own_stream("cuda"), own_stream("cuda"), own_stream("cuda", priority=-1)]
    handles = {s.cuda_stream for s in own}
    assert len(handles) == 3 and not handles & pooled
    assert own[0].priority == torch.cuda.Stream().priority
    assert own[2].priority == torch.cuda.Stream(priority=-1).priority  # clamped to the device's range alike
    flags = ctypes.c_uint()
    assert cuda_streams._runtime().cudaStreamGetFlags(ctypes.c_void_p(own[0].cuda_stream), ctypes.byref(flags)) == 0
    assert flags.value == 1  # cudaStreamNonBlocking, as torch's streams


@cuda
def test_a_stream_let_go_of_is_lent_again_and_never_to_two_owners_at_once():
    gc.collect()  # earlier owners let go now, not in the collection below
    first = own_stream("cuda")
    handle = first.cuda_stream
    held = own_stream("cuda")
    assert held.cuda_stream != handle
    del first
    gc.collect()
    assert handle in cuda_streams._let_go[torch.cuda.current_device(), 0]
    again, fresh = own_stream("cuda"), own_stream("cuda")
    assert again.cuda_stream == handle and fresh.cuda_stream not in (handle, held.cuda_stream)


@cuda
def test_work_on_an_own_stream_is_ordered_with_the_streams_it_waits_for():
    a = torch.randn(512, 512, device="cuda")
    stream = own_stream("cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        product = a @ a
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(product.cpu(), a.cpu() @ a.cpu(), rtol=1e-3, atol=1e-3)


@cuda
def test_two_fast_engines_in_one_process_share_no_stream():
    from client.engine.fast import FastEngine
    from client.model import load_model

    def streams(engine):
        graphed = engine.graphed
        found = [*engine.step_streams, graphed._taken_stream, graphed._capture_stream]
        found += [stream for shard in engine.shards for stream in shard.runner.streams]
        found += [queue.stream for part in engine.table.parts for queue in (part.to_host, part.to_gpu)]
        return [s.cuda_stream for s in found]

    for _ in range(64):  # the pool has wrapped, as in any process that made an engine before
        torch.cuda.Stream()
    model = load_model("tiny", seed=1, device="cuda")[0]
    engines = [FastEngine(model, device="cuda", max_batch=4, capacity=8, host_symbols=4, progress=False)
               for _ in range(2)]
    first, second = map(streams, engines)
    assert len(set(first)) == len(first) and len(set(second)) == len(second)
    assert not set(first) & set(second)
