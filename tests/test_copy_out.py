"""kernels/copy_out.py: the Triton kernel against its PyTorch reference; on a GPU into pinned host memory, replayed
in a CUDA graph. On a CPU the Triton kernel runs through the interpreter in a child process."""
import pytest
import torch

from kernels._common import INTERPRET
from kernels.copy_out import copy_out, copy_out_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a GPU")


def test_reference_copies_and_leaves_the_rest():
    dst, src = torch.zeros(5, 4), torch.randn(3, 4)
    copy_out_ref(dst[:3], src)
    assert torch.equal(dst[:3], src) and torch.equal(dst[3:], torch.zeros(2, 4))


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows", [0, 1, 255, 256, 257, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_triton_matches_reference(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    src = (torch.randn(rows, 4, generator=g) * 1e3).to(dtype).to(DEVICE)
    if dtype == torch.float32 and rows:
        src[0, 0] = float("nan")  # copied as bits
    dst, want = torch.full((rows + 3, 4), -7).to(dtype), torch.full((rows + 3, 4), -7).to(dtype)
    if DEVICE == "cuda":  # the GPU writes pinned host memory only
        dst = dst.pin_memory()
    copy_out(dst[:rows], src)
    copy_out_ref(want[:rows], src.cpu())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))  # the rows past it untouched


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("words", [1, 2, 16, 17, 1025])
def test_triton_copies_any_number_of_words(words):
    src = torch.arange(1, words + 1, dtype=torch.int32).to(DEVICE)
    dst = torch.zeros(words + 1, dtype=torch.int32)
    if DEVICE == "cuda":
        dst = dst.pin_memory()
    copy_out(dst[:words], src)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst[:words], src.cpu()) and dst[words] == 0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_out(torch.zeros(2, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_out(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="4-byte elements"):
        copy_out(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        copy_out(torch.zeros(4, 2), torch.zeros(2, 4).t())


@cuda
def test_host_memory_that_is_not_pinned_is_a_clear_error_on_gpu():
    with pytest.raises(ValueError, match="cannot be accessed"):  # Triton's own check, at the launch
        copy_out(torch.zeros(2, 4), torch.zeros(2, 4, device="cuda"))


@cuda
def test_one_compile_serves_every_length_on_gpu():
    """The runner compiles copy_out once before capturing its graphs: no later length may compile it again (a
    compile inside a capture fails; one while serving stalls a step)."""
    from kernels._jit import compiled_count
    from kernels.copy_out import _copy_out_kernel

    dst = torch.zeros(64, dtype=torch.int32).pin_memory()
    src = torch.arange(64, dtype=torch.int32, device="cuda")
    copy_out(dst[:3], src[:3])
    compiled = compiled_count([_copy_out_kernel])
    for words in (1, 2, 16, 17, 64):
        copy_out(dst[:words], src[:words])
    torch.cuda.synchronize()
    assert compiled_count([_copy_out_kernel]) == compiled and torch.equal(dst, src.cpu())


@cuda
def test_into_pinned_host_memory_in_a_cuda_graph_on_gpu():
    """Captured once, replayed with new values: each replay's values are in the host's memory once an event
    recorded after it has completed."""
    src = torch.zeros(64, 4, device="cuda")
    dst = torch.full((80, 4), -1.0, pin_memory=True)
    copy_out(dst[:64], src)  # compiled before capture, as the runner does
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        copy_out(dst[:64], src)
    for k in range(3):
        src.copy_(torch.randn(64, 4, device="cuda") + k)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert torch.equal(dst[:64], src.cpu()) and torch.equal(dst[64:], torch.full((16, 4), -1.0))


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
