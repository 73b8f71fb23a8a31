"""client/engine/cuda_streams.py: an engine's CUDA streams are its own, never torch's pooled ones, which two engines in
one process shared (their graphs then shared cuBLAS workspaces: wrong predictions or a hung GPU); copy_pieces
enqueues a move's pieces on the current stream."""
import ctypes
import re
import threading

import numpy as np
import pytest
import torch

from client.engine import cuda_streams
from client.engine.cuda_streams import copy_pieces, own_stream

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pooled():
    """Every stream torch's pools hand out at the priorities engines use (32 each, in turn)."""
    return {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(32)}


def test_the_runtime_is_found_under_each_name_it_ships_with_and_nothing_else():
    names = ["libcudart.so.13", "libcudart.so.12.4.127", "libcudart-d0da41ae.so.11.0", "libcudart.so"]
    assert all(cuda_streams._CUDART_FILE.match(name) for name in names)
    assert not any(cuda_streams._CUDART_FILE.match(name)
                   for name in ["libcudart_static.a", "libcudnn.so.9", "libnvrtc.so.13", "xlibcudart.so"])
    assert cuda_streams._mapped(re.compile(r"libtorch_cpu\.so")).endswith("/libtorch_cpu.so")
    assert cuda_streams._mapped(re.compile(r"libno_such_library\.so")) is None


def test_graphs_of_an_owner_on_the_current_gpu_are_reset_on_that_gpu_from_any_thread(monkeypatch):
    """Graphs captured on "cuda" (no index: the GPU current then, GPU 1 here) are reset with GPU 1 current when their
    owner is dropped in a thread on GPU 0: "cuda" read at the drop was that thread's GPU 0 (a context made there)."""
    import contextlib
    import gc
    import types

    gpu, current = {"now": 1}, []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpu["now"])

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device("cuda", gpu["now"]) if torch.device(d).index is None else torch.device(d))
        yield
    monkeypatch.setattr(torch.cuda, "device", device)
    resets = []
    owner = type("Owner", (), {})()  # a ReferenceStepper's graph, captured on "cuda" while GPU 1 was current
    cuda_streams.reset_graphs_when_dropped(owner, "cuda", [types.SimpleNamespace(reset=lambda: resets.append(1))])
    gpu["now"] = 0  # a thread that never set a GPU
    del owner
    gc.collect()
    assert resets == [1] and current == [torch.device("cuda", 1)]


@cuda
def test_own_streams_are_distinct_non_blocking_and_never_from_torchs_pool():
    own = [own_stream("cuda"), own_stream("cuda"), own_stream("cuda", priority=-1)]
    handles = {s.cuda_stream for s in own}
    assert len(handles) == 3 and not handles & _pooled()
    assert own[0].priority == torch.cuda.Stream().priority
    assert own[2].priority == torch.cuda.Stream(priority=-1).priority  # clamped to the device's range alike
    flags = ctypes.c_uint()
    assert cuda_streams._runtime().cudaStreamGetFlags(ctypes.c_void_p(own[0].cuda_stream), ctypes.byref(flags)) == 0
    assert flags.value == 1  # cudaStreamNonBlocking, as torch's streams


def test_copy_pieces_copies_each_piece_and_nothing_else_on_the_cpu():
    src, dst = torch.arange(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    copy_pieces(dst, src, [(0, 10), (10, 40), (60, 100)])
    assert torch.equal(dst[:40], src[:40]) and not dst[40:60].any() and torch.equal(dst[60:], src[60:])


@cuda
def test_copy_pieces_both_ways_on_the_current_stream_after_its_work():
    """Pinned host memory to the GPU and back, in pieces, on a side stream made current: each copy runs after the
    work queued before it there (a long kernel, then a fill), and the bytes come back bit for bit."""
    values = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    host, back = values.pin_memory(), torch.zeros_like(values).pin_memory()
    gpu = torch.zeros(values.numel(), dtype=torch.uint8, device="cuda")
    pieces = [(0, 1 << 20), (1 << 20, (2 << 20) + 5), ((2 << 20) + 5, 3 << 20)]
    stream = own_stream("cuda")
    with torch.cuda.stream(stream):
        copy_pieces(gpu, host, pieces)
        torch.cuda._sleep(50_000_000)  # the copy back below would read the wrong bytes if run unordered
        gpu[:7].fill_(9)
        copy_pieces(back, gpu, pieces)
    stream.synchronize()
    want = values.clone()
    want[:7] = 9
    assert torch.equal(back, want)
    with pytest.raises(ValueError, match="out of range"):
        copy_pieces(gpu, host, [(0, (3 << 20) + 1)])
    with pytest.raises(ValueError, match="one-dimensional byte tensors"):
        copy_pieces(gpu.view(torch.int32), host.view(torch.int32), pieces)


@cuda
def test_a_collected_stream_is_never_handed_out_again():
    first = own_stream("cuda")
    handle = first.cuda_stream
    del first
    assert handle not in {own_stream("cuda").cuda_stream for _ in range(8)}


@cuda
def test_work_on_an_own_stream_waits_for_the_streams_it_is_told_to():
    a = torch.zeros(512, 512, device="cuda")
    torch.cuda._sleep(50_000_000)  # the fill below lands well after the product would have run unordered
    a.fill_(1.0)
    stream = own_stream("cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        product = a @ a
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(product.cpu(), torch.full((512, 512), 512.0))


@cuda
def test_two_fast_engines_in_one_process_keep_streams_of_their_own():
    from client.engine.fast import FastEngine
    from client.model import load_model

    def streams(engine):
        graphed = engine.graphed
        found = [*engine.step_streams, graphed._taken_stream, graphed._capture_stream]
        found += [stream for shard in engine.shards for stream in shard.runner.streams]
        found += [queue.stream for part in engine.table.parts for queue in (part.to_host, part.to_gpu)]
        return [s.cuda_stream for s in found]

    model = load_model("tiny", seed=1, device="cuda")[0]
    engines = [FastEngine(model, device="cuda", max_batch=4, capacity=8, host_symbols=4, progress=False)
               for _ in range(2)]
    first, second = map(streams, engines)
    assert len(set(first)) == len(first) == 9 and len(set(second)) == len(second) == 9
    assert not set(first) & set(second) and not (set(first) | set(second)) & _pooled()


@cuda
def test_two_fast_engines_stepping_at_once_from_two_threads_answer_as_each_alone():
    """The case the shared streams broke (one process, two engines at once: in-process shards on one GPU, an engine
    starting while another serves): each engine's answers equal, to the bit, its answers to the same steps alone."""
    from client.engine.fast import FastEngine
    from client.model import load_model

    model = load_model("small", seed=0, device="cuda")[0]
    engines = [FastEngine(model, device="cuda", max_batch=8, capacity=16, host_symbols=0, progress=False)
               for _ in range(2)]
    rng = np.random.default_rng(0)
    steps = [[rng.standard_normal((8, 79)).astype(np.float32) for _ in range(40)] for _ in engines]

    def run(engine, features, symbols, answers):
        for step in features:
            answers.append(engine.step(symbols, step))

    alone = [[], []]
    for i, engine in enumerate(engines):  # one engine at a time, on its first eight symbols
        run(engine, steps[i], [f"A{k}" for k in range(8)], alone[i])
    together = [[], []]
    threads = [threading.Thread(target=run, args=(engine, steps[i], [f"B{k}" for k in range(8)], together[i]))
               for i, engine in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a step never ended: the engines share a stream"
    for i in range(2):
        assert len(together[i]) == len(alone[i]) == 40
        for got, want in zip(together[i], alone[i]):
            np.testing.assert_array_equal(got, want)
