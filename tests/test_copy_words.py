"""kernels/copy_words.py: the Triton kernel against its PyTorch reference, both ways; on a GPU between the GPU and
pinned host memory, replayed in a CUDA graph, and reading host memory written after its launch. On a CPU the Triton
kernel runs through the interpreter in a child process."""
import pytest
import torch

from kernels._common import INTERPRET
from kernels.copy_words import copy_words, copy_words_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a GPU")


def host(t):
    """t in host memory, pinned where a GPU will read or write it."""
    t = t.cpu()
    return t.pin_memory() if DEVICE == "cuda" else t


def test_reference_copies_and_leaves_the_rest():
    dst, src = torch.zeros(5, 4), torch.randn(3, 4)
    copy_words_ref(dst[:3], src)
    assert torch.equal(dst[:3], src) and torch.equal(dst[3:], torch.zeros(2, 4))


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("to_host", [True, False], ids=["to_host", "from_host"])
@pytest.mark.parametrize("rows", [0, 1, 255, 256, 257, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_triton_matches_reference(rows, dtype, to_host):
    g = torch.Generator().manual_seed(rows)
    values = (torch.randn(rows, 4, generator=g) * 1e3).to(dtype)
    if dtype == torch.float32 and rows:
        values[0, 0] = float("nan")  # copied as bits
    src = values.to(DEVICE) if to_host else host(values)
    dst = torch.full((rows + 3, 4), -7).to(dtype)
    dst = host(dst) if to_host else dst.to(DEVICE)
    want = torch.full((rows + 3, 4), -7).to(dtype)
    copy_words(dst[:rows], src)
    copy_words_ref(want[:rows], values)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu().view(torch.int32), want.view(torch.int32))  # the rows past it untouched


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("words", [1, 2, 16, 17, 1025])
def test_triton_copies_any_number_of_words_at_any_word_offset(words, offset):
    """A step's inputs past its sequence slots start 4 bytes a sequence into their buffer: any word offset."""
    values = torch.arange(1, words + offset + 1, dtype=torch.int32)
    to_host = host(torch.zeros(words + offset + 1, dtype=torch.int32))
    copy_words(to_host[offset:offset + words], values.to(DEVICE)[offset:])
    from_host = torch.zeros(words + offset + 1, dtype=torch.int32, device=DEVICE)
    copy_words(from_host[offset:offset + words], host(values)[offset:])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for dst in (to_host, from_host.cpu()):
        assert torch.equal(dst[offset:offset + words], values[offset:])
        assert not dst[:offset].any() and dst[-1] == 0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_words(torch.zeros(2, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_words(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="4-byte elements"):
        copy_words(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        copy_words(torch.zeros(4, 2), torch.zeros(2, 4).t())


@cuda
def test_host_memory_that_is_not_pinned_is_a_clear_error_on_gpu():
    with pytest.raises(ValueError, match="cannot be accessed"):  # Triton's own check, at the launch
        copy_words(torch.zeros(2, 4), torch.zeros(2, 4, device="cuda"))
    with pytest.raises(ValueError, match="cannot be accessed"):
        copy_words(torch.zeros(2, 4, device="cuda"), torch.zeros(2, 4))


@cuda
def test_both_on_the_gpu_is_a_clear_error_on_gpu():
    with pytest.raises(ValueError, match="must be in host memory"):
        copy_words(torch.zeros(2, 4, device="cuda"), torch.zeros(2, 4, device="cuda"))


@cuda
def test_one_compile_serves_every_copy_on_gpu():
    """The runner compiles copy_words once before capturing its graphs: no later length, word offset or direction
    may compile it again (a compile inside a capture fails; one while serving stalls a step)."""
    from kernels._jit import compiled_count
    from kernels.copy_words import _copy_words_kernel

    on_host = torch.zeros(64, dtype=torch.int32).pin_memory()
    on_gpu = torch.arange(64, dtype=torch.int32, device="cuda")
    copy_words(on_host[:3], on_gpu[:3])
    compiled = compiled_count([_copy_words_kernel])
    for words in (1, 2, 16, 17, 63):
        for offset in (0, 1):
            copy_words(on_host[offset:offset + words], on_gpu[offset:offset + words])
    back = torch.zeros(64, dtype=torch.int32, device="cuda")
    copy_words(back[1:18], on_host[1:18])
    copy_words(back[18:], on_host[18:])
    torch.cuda.synchronize()
    assert compiled_count([_copy_words_kernel]) == compiled
    assert torch.equal(on_host, on_gpu.cpu()) and torch.equal(back[1:], on_gpu[1:])


@cuda
def test_both_ways_in_a_cuda_graph_on_gpu():
    """Captured once, replayed with new values: each replay reads the host's inputs as they are when it runs, and
    its outputs are in the host's memory once an event recorded after it has completed."""
    host_in = torch.zeros(64, 4, pin_memory=True)
    host_out = torch.full((80, 4), -1.0, pin_memory=True)
    on_gpu = torch.zeros(64, 4, device="cuda")
    copy_words(host_out[:64], on_gpu)  # compiled before capture, as the runner does
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        copy_words(on_gpu, host_in)
        on_gpu.mul_(2)
        copy_words(host_out[:64], on_gpu)
    for k in range(3):
        host_in.copy_(torch.randn(64, 4) + k)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert torch.equal(host_out[:64], host_in * 2) and torch.equal(host_out[64:], torch.full((16, 4), -1.0))


@cuda
def test_reads_host_memory_written_after_its_launch_on_gpu():
    """A request joins a step already launched by writing host memory the step's copy reads when it runs
    (runner.StepInputs.join): launched behind a long kernel, the copy sees what the host wrote after the launch."""
    host_in = torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    on_gpu = torch.full((1024,), -1, dtype=torch.int32, device="cuda")
    copy_words(on_gpu[:1], host_in[:1])  # compiled
    torch.cuda.synchronize()
    launched = torch.cuda.Event()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on a GPU near 2 GHz: the host's writes land while it runs
    launched.record()
    copy_words(on_gpu, host_in)
    assert not launched.query(), "the copy must be launched while the GPU is still busy"
    host_in.copy_(torch.arange(1024, dtype=torch.int32))
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), torch.arange(1024, dtype=torch.int32))


INTERPRETER_CASES = "triton_matches or any_number"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
