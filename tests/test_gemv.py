"""kernels/gemv.py: the Triton kernel against its fp64 reference for 16-bit, fp32 and split (fp32 rows as fp16
halves, then fp16 rows) weights at a step's one row (and a second when live), its launch rule, and the engine's products routed through it.
On a CPU it runs through the interpreter in a child process; on a GPU the model's shapes run too, and a chain of
kernels launched with programmatic dependent launch inside a CUDA graph gives the bits of the same chain without."""

import pytest
import torch

from kernels._common import INTERPRET
from kernels.gemv import MIN_PROGRAMS, TILE_BYTES, config, gemv, gemv_ref, supports
from kernels.skinny_matmul import LO_SCALE, split_fp16

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def make(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g)
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)


def weights(w, kind):
    """kwargs of gemv for the fp32 w stored as `kind`: fp32, fp16, bf16, or split:R (its first R rows split)."""
    if kind.startswith("split"):
        rows = int(kind.partition(":")[2])
        hi, lo = split_fp16(w[:rows])
        return {"weight": torch.cat([hi, w[rows:].half()]).contiguous(), "weight_lo": lo.contiguous()}
    return {"weight": w.to(getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[kind]))}


def test_reference_matches_equations():
    x, w, b = make(1, 24, 32, 0)
    torch.testing.assert_close(gemv_ref(x, w, b, relu=True).double(),
                               torch.relu(x.double() @ w.double().t() + b.double()), rtol=1e-6, atol=1e-6)
    y = gemv_ref(x, w.half(), b)  # 16-bit W: x rounded to its dtype first
    torch.testing.assert_close(y.double(), x.half().double() @ w.half().double().t() + b.double(),
                               rtol=1e-6, atol=1e-6)
    split = gemv_ref(x, **weights(w, "split:10"))  # split rows: about fp32; the others fp16 with x rounded
    hi, lo = split_fp16(w[:10])
    exact = x.double() @ (hi.double() + lo.double() / LO_SCALE).t()
    torch.testing.assert_close(split[:, :10].double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(split[:, 10:], gemv_ref(x, w[10:].half()))


def test_config_streams_w_through_every_sm():
    for N, K, split, size in [(2048, 2048, False, 2), (2048, 4096, False, 2), (4096, 2048, False, 2),
                              (8192, 2048, False, 4), (8448, 2048, True, 2), (2048, 4096, False, 4)]:
        block_n, block_k, _ = config(N, K, split, size)
        assert block_k >= K and block_n * block_k * size * (2 if split else 1) <= TILE_BYTES
        assert -(-N // block_n) >= MIN_PROGRAMS
    assert config(40, 64, False, 2)[0] == 1  # few outputs: one a program
    assert supports(2048, 4096) and not supports(2048, 8192)  # an fp32 row past TILE_BYTES


def test_refuses_bad_inputs():
    x, w, _ = make(3, 16, 32, 1)
    live = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one row, or two with live_rows"):
        gemv_ref(x[:2], w)  # a step of more rows goes through skinny_matmul or cuBLAS
    with pytest.raises(ValueError, match="one row, or two with live_rows; got 3 rows"):
        gemv_ref(x, w, live_rows=live)
    with pytest.raises(ValueError, match="one-element int32"):
        gemv_ref(x[:2], w, live_rows=live.long())
    with pytest.raises(ValueError, match="2-D float32/float16/bfloat16"):
        gemv_ref(x[:1], w.double())
    with pytest.raises(ValueError, match="split weight"):
        gemv_ref(x[:1], w, weight_lo=w.half())  # the hi half must be fp16 too


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("N,K", [(40, 64), (300, 79), (520, 96)])  # programs of 1, 2 outputs; K not a power of two
@pytest.mark.parametrize("kind", ["fp32", "fp16", "split:20"])
def test_triton_matches_reference(N, K, kind):
    x, w, b = make(1, N, K, N + K)
    y = gemv(x, **weights(w, kind))
    ref = gemv_ref(x, **weights(w, kind))
    assert y.shape == (1, N) and y.dtype == torch.float32
    assert (y - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("live", [1, 2])
@pytest.mark.parametrize("kind", ["fp32", "fp16", "split:20"])
def test_second_row_only_when_live(live, kind):
    """Two rows with the live row count on the device: the second multiplied when live, zeros when not; the first
    row the same bits as alone."""
    x, w, b = make(2, 300, 96, live)
    count = torch.tensor([live], dtype=torch.int32, device=DEVICE)
    y = gemv(x, **weights(w, kind), bias=b, relu=True, live_rows=count)
    ref = gemv_ref(x, **weights(w, kind), bias=b, relu=True, live_rows=count)
    assert (y - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    assert torch.equal(y[:1], gemv(x[:1], **weights(w, kind), bias=b, relu=True))
    if live == 1:
        assert (y[1] == 0).all()
    else:
        assert torch.equal(y[1:], gemv(x[1:], **weights(w, kind), bias=b, relu=True))


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_bias_relu_epilogue_and_a_row_of_a_wider_tensor(out_dtype):
    x, w, b = make(1, 96, 128, 5)
    wide = torch.zeros(3, 200, device=DEVICE)
    wide[1, 50:178] = x[0]  # the row inside a larger tensor (an offset view)
    for kind in ("fp32", "fp16", "split:64"):
        y = gemv(wide[1:2, 50:178], **weights(w, kind), bias=b, relu=True, out_dtype=out_dtype)
        ref = gemv_ref(x, **weights(w, kind), bias=b, relu=True)
        assert y.dtype == out_dtype and (y >= 0).all() and (y == 0).any()
        torch.testing.assert_close(y.float(), ref, rtol=1e-3 if out_dtype == torch.float16 else 1e-6, atol=1e-6)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
def test_engine_products_route_through_it():
    """The fast engine's Linear: one row through gemv (its bits), two inside live_rows(), more through its other
    route."""
    from client.engine.fast.layers import Linear, live_rows
    x, w, b = make(3, 64, 128, 9)
    for dtype in (torch.float32, torch.float16):
        linear = Linear(w.cpu(), b.cpu(), dtype, DEVICE)
        linear.use_skinny(True)
        linear.use_gemv(True)
        assert torch.equal(linear(x[:1]), gemv(x[:1], linear.weight, b))
        assert torch.equal(linear.product(x[:1]), gemv(x[:1], linear.weight))
        relu = linear.relu(x[:1])
        assert relu.dtype == dtype and torch.equal(relu, gemv(x[:1], linear.weight, b, relu=True, out_dtype=dtype))
        rows = linear(x)  # three rows: the other route, the same product within its rounding
        torch.testing.assert_close(rows[:1], linear(x[:1]), rtol=1e-3, atol=1e-3)
        unused = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        with live_rows(unused):
            assert torch.equal(linear(x[:2]), gemv(x[:2], linear.weight, b, live_rows=unused))
            assert (linear(x[:2])[1] == 0).all()
        torch.testing.assert_close(linear(x[:2]), rows[:2])  # outside: two rows through the other route
        linear.use_gemv(False)
        assert linear.gemv is None


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="the model's shapes, on a GPU")
@pytest.mark.parametrize("kind,N,K", [("fp32", 8192, 2048), ("fp32", 2048, 4096), ("split:8192", 8448, 2048),
                                      ("fp16", 4096, 2048), ("fp16", 2048, 4096), ("bf16", 2048, 2048)])
def test_model_shapes_on_gpu(kind, N, K):
    x, w, b = make(1, N, K, N + K)
    y = gemv(x, **weights(w, kind), bias=b)
    ref = gemv_ref(x, **weights(w, kind), bias=b)
    # fp32 sums over K terms in the FMA units: ~1e-7 of a row's scale per sqrt(K)
    assert torch.isfinite(y).all() and (y - ref).abs().max().item() <= 1e-7 * K**0.5 * ref.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="programmatic dependent launch, on a GPU")
def test_pdl_chain_in_a_graph_keeps_its_order():
    """A chain where each product reads what the kernel just ahead wrote (a norm's or a product's output): captured in a CUDA graph with PDL, its bits equal the same chain launched without it, every replay."""
    import kernels._pdl as pdl
    from kernels import add_rms_norm
    x, _, _ = make(1, 2048, 2048, 3)
    ws = [make(1, 2048, 2048, 10 + i)[1].half() for i in range(24)]
    norm_w = torch.ones(2048, device=DEVICE)

    def chain(residual):
        for w_up, w_down in zip(ws[::2], ws[1::2]):  # norm -> product -> product, each reading the one ahead
            h = add_rms_norm(residual, torch.zeros_like(residual), None, norm_w, 1e-6, out_dtype=torch.float16)
            up = gemv(h, w_up, relu=True, out_dtype=torch.float16)
            residual = residual + 0.5 * gemv(up, w_down)
        return residual

    before = pdl.PDL
    try:
        pdl.PDL = False
        expect = chain(x.clone())
        pdl.PDL = True
        start = x.clone()
        chain(start.clone())  # warm-up: compiles the PDL launches
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(start)
    finally:
        pdl.PDL = before
    for _ in range(20):
        start.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect)


INTERPRETER_CASES = "triton_matches or epilogue or route_through or only_when_live"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
