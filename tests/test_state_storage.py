"""How the state kernels store state: every state kernel on slot-major tables (each component a strided view of
one byte buffer [S, slot bytes]), and the three matrix states (mLSTM C, Mamba2 h, RetNet S) in fp16/bf16 with
round-to-nearest or stochastic rounding (kernels/state_rounding.py).

Triton cases run on a GPU when there is one, else under the interpreter in a child process (see
tests/test_kernels.py); references and bad input run here; full-size cases need a GPU.
"""
import importlib

import pytest
import torch

import kernels
from kernels._common import INTERPRET
from kernels.state_rounding import StochasticRounding, round_ref, stochastic_bits_ref
from test_kernels import FULL_DIMS, SMALL_DIMS, STATE_OPS, assert_close, make_args, slot_args

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")

OPS = {name: (op, ref) for name, (op, ref, _) in STATE_OPS.items()}
OPS.update(mlstm_input=(kernels.mlstm_input, kernels.mlstm_input_ref),
           slstm_input=(kernels.slstm_input, kernels.slstm_input_ref),
           slstm_output=(kernels.slstm_output, kernels.slstm_output_ref))
MATRIX = {"mlstm_step": "C", "mamba2_state_update": "h", "retention_step": "S"}
HALF = [torch.float16, torch.bfloat16]
MANTISSA = {torch.float16: (10, 2.0**-24), torch.bfloat16: (7, 2.0**-133)}  # bits, smallest subnormal
GAP = 16  # poisoned bytes before, between and after a slot's components: another component's bytes


def slot_major(tables, slots):
    """Copies of `tables` ({name: [S, ...] tensor}) as views of one uint8 buffer [S, slot bytes] holding each
    slot's components one after another, GAP bytes of 0xFF (NaN in every float dtype, -1 in int32) around
    each. Returns (buffer, views, {name: byte range within a slot})."""
    regions, end = {}, GAP
    for name, t in tables.items():
        nbytes = t[0].numel() * t.element_size()
        regions[name] = (end, end + nbytes)
        end += -(-nbytes // GAP) * GAP + GAP
    buf = torch.full((slots, end), 0xFF, dtype=torch.uint8, device=next(iter(tables.values())).device)
    views = {}
    for name, t in tables.items():
        start, stop = regions[name]
        view = buf[:, start:stop].view(t.dtype)
        views[name] = view.unflatten(1, t.shape[1:]) if t.dim() > 1 else view[:, 0]
        views[name].copy_(t)
        assert views[name].stride(0) * t.element_size() == end and not views[name].is_contiguous()
    return buf, views, regions


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(actual, expected, name=""):
    """Bit for bit, except that any NaN equals any NaN (padding rows compute from NaN-poisoned state)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    same = bits(actual) == bits(expected)
    if actual.is_floating_point():
        same |= torch.isnan(actual) & torch.isnan(expected)
    assert same.all(), f"{name}: {(~same).sum().item()} of {same.numel()} differ"


def assert_alike(actual, expected, name=""):
    """Bit for bit on the CPU (interpreter, references). On a GPU two compilations of a kernel (contiguous or
    slot-major strides, 16- or 32-bit state) may order their fp32 sums differently: there, within fp32 rounding
    (16-bit values within one step of their grid)."""
    if not actual.is_cuda:
        assert_same_bits(actual, expected, name)
    elif not actual.is_floating_point():
        assert torch.equal(actual, expected), name
    elif actual.element_size() == 2:
        assert_within_one_ulp(actual, expected, name, min_equal=0.9)
    else:
        scale = expected.float().nan_to_num().abs().max().clamp_min(1e-30)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale.item(), equal_nan=True, msg=name)


def assert_within_one_ulp(actual, expected, name="", min_equal=0.99, rtol=2e-5):
    """16-bit values at most one step apart on the ordered grid of the dtype (or within fp32 agreement,
    rtol scaled by the largest magnitude: where the update cancels, a value is far smaller than its terms and
    their fp32 rounding can exceed its own ulp), and nearly all equal: two fp32 results that differ in their
    last bits round apart rarely, while rounding from other random bits (a stale counter, a wrong index)
    would differ in about half of the values."""
    def ordered(t):
        b = bits(t).to(torch.int32) & 0xFFFF
        return torch.where(b >= 0x8000, -(b & 0x7FFF), b)
    steps = (ordered(actual) - ordered(expected)).abs()
    close = (actual.float() - expected.float()).abs() <= rtol * expected.float().abs().max()
    far = (steps > 1) & ~close
    assert not far.any(), f"{name}: {far.sum().item()} values more than one ulp apart"
    assert (steps == 0).float().mean().item() >= min_equal, f"{name}: {(steps > 0).sum().item()} values differ"


def ulp(v, dtype):
    mantissa, smallest = MANTISSA[dtype]
    _, exponent = torch.frexp(v.abs())
    return torch.ldexp(torch.ones_like(v), exponent - 1 - mantissa).clamp(min=smallest)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def case(op_name, rows, slots, full=False, dims=None, seed=0, device=DEVICE):
    """(arguments without the slots, state names, names of the states the op writes) for one call, at small
    sizes, the full model's or `dims`."""
    if op_name in STATE_OPS:
        dims = dims or (FULL_DIMS[op_name] if full else SMALL_DIMS[op_name][0])
        args = make_args(op_name, rows, slots, dims, device=device, seed=seed)
        names = STATE_OPS[op_name][2]
        return args, names, tuple(n for n in names if (op_name, n) != ("slstm_step", "y"))  # y: read only
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    if op_name == "mlstm_input":
        inner, gates = (4096, 16) if full else (72, 4)
        args = dict(xm=randn(rows, inner), conv_state=randn(slots, inner, 3), conv_weight=randn(inner, 4) * 0.5,
                    conv_bias=randn(inner), qkv_weight=randn(inner // 4, 3, 4, 4) * 0.5,
                    gate_weight=randn(gates, 3 * inner) / inner**0.5, gate_bias=randn(gates))
        return args, ("conv_state",), ("conv_state",)
    if op_name == "slstm_input":
        width = 2048 if full else 40
        args = dict(x=randn(rows, width), delta=randn(rows, width), bias=randn(width),
                    norm_weight=randn(width).abs() + 0.5, rms_eps=1e-6, ln_weight=randn(width).abs() + 0.5,
                    conv_state=randn(slots, width, 3), conv_weight=randn(width, 4), conv_bias=randn(width))
        return args, ("conv_state",), ("conv_state",)
    if op_name == "slstm_output":
        width = 2048 if full else 48
        args = dict(y=randn(rows, width), xin=randn(rows, width), gn_weight=randn(width), gn_bias=randn(width),
                    ln_weight=randn(width), groups=4, out_dtype=torch.float32, y_state=randn(slots, width))
        return args, ("y_state",), ("y_state",)
    raise KeyError(op_name)


def run(op, args, tables, rows_slots, **extra):
    """op on copies of the inputs (slstm_input updates x in place), with `tables` as its states and rows_slots
    (slot_args) its rows' slots."""
    call = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return as_tuple(op(**call, **tables, **extra, **rows_slots))


def layout(op_name, live, padding, idle, device, seed=1):
    """Live rows on distinct random slots, then padding rows past every sequence (empty sequences at the last
    slot: slot_args): (slots in all, the rows' plan, the live slots, the slots the op may write: the live ones)."""
    slots = live + idle + 1
    live_slots = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))[:live].to(device)
    rows_slots = slot_args(op_name, live_slots, padding, slots - 1, device)
    return slots, rows_slots, live_slots, live_slots


def live_outputs(op_name, out, live):
    """The outputs' live rows: the op may leave padding rows unwritten (mlstm_input's gate parts [P, B, G] hold
    their rows in dim 1)."""
    return [o[:, :live] if (op_name, k) == ("mlstm_input", 2) else o[:live] for k, o in enumerate(out)]


def poison_padding_slot(tables, pad):
    for t in tables.values():
        t[pad] = 2**30 if t.dtype == torch.int32 else float("nan")


def assert_only_written(buf, before, regions, written, written_slots):
    """Bytes change only in the written components of the written slots."""
    allowed = torch.zeros_like(buf, dtype=torch.bool)
    for name in written:
        start, stop = regions[name]
        allowed[written_slots.long(), start:stop] = True
    changed = buf != before
    assert not (changed & ~allowed).any(), f"{(changed & ~allowed).sum().item()} bytes written outside the rows' states"


# ---------------------------------------------------------------------------------------------------------
# Slot-major tables: every state kernel, bit for bit as on contiguous tables

def check_slot_major(op_name, impl, device, full=False):
    """One step with the op's states carved out of one slot-major buffer, beside contiguous copies: outputs
    and states bit for bit alike, and no byte changed outside the written components of the rows' slots."""
    op = OPS[op_name][impl]
    live = 3
    slots, rows_slots, _, written_slots = layout(op_name, live, padding=2, idle=3, device=device)
    args, names, written = case(op_name, live + 2, slots, full=full, device=device)
    tables = {name: args.pop(name) for name in names}
    poison_padding_slot(tables, slots - 1)
    buf, views, regions = slot_major(tables, slots)
    before = buf.clone()
    contiguous = {name: t.clone() for name, t in tables.items()}
    outs = [live_outputs(op_name, run(op, args, states, rows_slots), live) for states in (views, contiguous)]
    for got, want in zip(*outs):
        assert_alike(got, want, "output")
    kept = torch.ones(slots, dtype=torch.bool, device=device)
    kept[-1] = False  # the padding slot: padding rows race on it
    for name in names:
        assert_alike(views[name][kept], contiguous[name][kept], name)
    assert_only_written(buf, before, regions, written, written_slots)


def check_distinct_slot_strides(op_name, impl, device):
    """Each state a view of its own wider table, so that every state has its own slot stride."""
    op = OPS[op_name][impl]
    slots, rows_slots, _, _ = layout(op_name, 3, padding=0, idle=2, device=device)
    args, names, _ = case(op_name, 3, slots, device=device)
    tables = {name: args.pop(name) for name in names}
    views = {}
    for i, (name, t) in enumerate(tables.items()):
        wide = torch.full((slots, t[0].numel() + 8 * (i + 1)), float("nan"), device=device).to(t.dtype)
        views[name] = wide[:, 4 * (i + 1):4 * (i + 1) + t[0].numel()].view(t.shape)
        views[name].copy_(t)
    assert len({v.stride(0) for v in views.values()}) == len(views)
    for got, want in zip(run(op, args, views, rows_slots), run(op, args, tables, rows_slots)):
        assert_same_bits(got, want, "output")
    for name in names:
        assert_same_bits(views[name], tables[name], name)


MULTI_STATE_OPS = [name for name, (_, _, states) in STATE_OPS.items() if len(states) > 1]


@pytest.mark.parametrize("op_name", MULTI_STATE_OPS)
def test_reference_distinct_slot_strides(op_name):
    check_distinct_slot_strides(op_name, 1, "cpu")


@runs_triton
@pytest.mark.parametrize("op_name", MULTI_STATE_OPS)
def test_triton_small_distinct_slot_strides(op_name):
    check_distinct_slot_strides(op_name, 0, DEVICE)


INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@pytest.mark.parametrize("op_name", list(OPS))
def test_reference_slot_major(op_name):
    check_slot_major(op_name, 1, "cpu")


@runs_triton
@pytest.mark.parametrize("op_name", list(OPS))
def test_triton_small_slot_major(op_name):
    check_slot_major(op_name, 0, DEVICE)


# ---------------------------------------------------------------------------------------------------------
# 16-bit matrix states

def check_half_state(op_name, dtype, stochastic, impl, device, full=False, dims=None, live=3, padding=2):
    """One step on a slot-major table whose matrix state is `dtype`, beside an fp32 run from the same values.

    The readout equals the fp32 run's bit for bit (it reads the fp32 state before rounding); the stored state
    is the fp32 run's new state rounded by round_ref with the rows' counters and the salt, bit for bit; the
    small states equal the fp32 run's; nothing outside the rows' states (the counter included) is written.
    For Triton (impl 0), also against the reference from the same 16-bit state: within one ulp (their fp32
    math differs in the last bits, which can move a rounding by one step), the readout close."""
    op = OPS[op_name][impl]
    matrix = MATRIX[op_name]
    slots, rows_slots, live_slots, written_slots = layout(op_name, live, padding, idle=2, device=device)
    args, names, _ = case(op_name, live + padding, slots, full=full, dims=dims, device=device)
    tables = {name: args.pop(name) for name in names}
    poison_padding_slot(tables, slots - 1)
    tables[matrix] = tables[matrix].to(dtype)
    counter = torch.randint(-2**31, 2**31 - 1, (slots,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    buf, views, regions = slot_major({**tables, "counter": counter.to(device)}, slots)
    counter = views.pop("counter")
    rounding = StochasticRounding(counter, 1234) if stochastic else "nearest"
    fp32 = {name: t.float() if name == matrix else t.clone() for name, t in tables.items()}
    initial = {name: t.clone() for name, t in views.items()}
    before = buf.clone()
    out = run(op, args, views, rows_slots, rounding=rounding)
    out32 = run(op, args, fp32, rows_slots)
    assert_alike(out[0][:live], out32[0][:live], "readout")
    noise = stochastic_bits_ref(rounding, live_slots, views[matrix].shape[1:]) if stochastic else None
    assert_alike(views[matrix][live_slots], round_ref(fp32[matrix][live_slots], dtype, noise), matrix)
    for name in names:
        if name != matrix:
            assert_alike(views[name][live_slots], fp32[name][live_slots], name)
    assert_only_written(buf, before, regions, names, written_slots)
    if impl == 0:
        ref_out = run(OPS[op_name][1], args, initial, rows_slots, rounding=rounding)
        assert_close(out[0][:live], ref_out[0][:live])
        assert_within_one_ulp(views[matrix][live_slots], initial[matrix][live_slots], matrix)


@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state(op_name, dtype, stochastic):
    check_half_state(op_name, dtype, stochastic, 1, "cpu")


@runs_triton
@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_small_half_state(op_name, dtype, stochastic):
    check_half_state(op_name, dtype, stochastic, 0, DEVICE)


@runs_triton
@pytest.mark.parametrize("op_name", ["mlstm_step", "retention_step"])
def test_triton_small_half_state_in_several_chunks(op_name, monkeypatch):
    """Small tiles: the d loop runs over several chunks (the counter loaded in each) and value-column tiles."""
    monkeypatch.setattr(importlib.import_module(f"kernels.{op_name}"), "MAX_TILE", 16 * 16)
    check_half_state(op_name, torch.float16, True, 0, DEVICE, dims=dict(heads=2, head_dim=40))


@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state_tracks_fp32(op_name, dtype, stochastic):
    """Steps of 16-bit state (the counter advancing) stay within their rounding of an fp32 run: each step
    adds at most one gap at the element's largest magnitude (the updates are linear in the state with
    factors <= 1), doubled for crossing a binade."""
    steps, rows = 6, 3
    matrix = MATRIX[op_name]
    args, names, _ = case(op_name, rows, rows, device="cpu")
    half = {name: args.pop(name) for name in names}
    half[matrix] = half[matrix].to(dtype)
    fp32 = {name: t.float() if name == matrix else t.clone() for name, t in half.items()}
    rows_slots = slot_args(op_name, range(rows))
    counter = torch.zeros(rows, dtype=torch.int32)
    rounding = StochasticRounding(counter, 7) if stochastic else None
    peak = fp32[matrix].abs()
    ref = OPS[op_name][1]
    for _ in range(steps):
        run(ref, args, half, rows_slots, rounding=rounding)
        run(ref, args, fp32, rows_slots)
        counter += 1
        peak = torch.maximum(peak, fp32[matrix].abs())
    error = (half[matrix].float() - fp32[matrix]).abs()
    assert (error <= 2 * steps * ulp(peak, dtype)).all()
    assert (error > 0).any()


@pytest.mark.parametrize("op_name", list(MATRIX))
def test_reference_stochastic_rounding_follows_counter_and_salt(op_name):
    """The same counter and salt give the same bits; another salt or counter, other bits (within one ulp)."""
    matrix = MATRIX[op_name]
    args, names, _ = case(op_name, 2, 2, device="cpu")
    start = {name: args.pop(name) for name in names}
    start[matrix] = start[matrix].to(torch.bfloat16)
    rows_slots = slot_args(op_name, [1, 0])

    def stored(counter, salt):
        tables = {name: t.clone() for name, t in start.items()}
        rounding = StochasticRounding(torch.tensor(counter, dtype=torch.int32), salt)
        run(OPS[op_name][1], args, tables, rows_slots, rounding=rounding)
        return tables[matrix]

    base = stored([3, 8], 1)
    assert_same_bits(stored([3, 8], 1), base)
    for other in (stored([3, 8], 2), stored([4, 9], 1)):
        assert (bits(other) != bits(base)).any(dim=-1).any(dim=-1).all()  # in every slot and head
        assert_within_one_ulp(other, base, min_equal=0)


@pytest.mark.parametrize("op_name,name,make_bad,match", [
    ("mlstm_step", "n", lambda t: t.half(), r"n is a state and must be float32, got torch.float16 \(16-bit storage "
                                           r"is for the large matrix states only\)"),
    ("mlstm_step", "m", lambda t: t.bfloat16(), "m is a state and must be float32, got torch.bfloat16"),
    ("retention_step", "scale", lambda t: t.half(), "scale is a state and must be float32, got torch.float16"),
    ("slstm_step", "c", lambda t: t.bfloat16(), "c is a state and must be float32, got torch.bfloat16"),
    ("rglru_step", "h", lambda t: t.half(), "h is a state and must be float32, got torch.float16"),
    ("causal_conv_update", "conv_state", lambda t: t.half(), "conv_state is a state and must be float32, got"),
    ("mlstm_step", "C", lambda t: t.double(), "C is a state and must be float32, float16 or bfloat16, got"),
    ("mamba2_state_update", "h", lambda t: t.to(torch.int16), "h is a state and must be float32, float16 or"),
], ids=["mlstm-n", "mlstm-m", "retention-scale", "slstm-c", "rglru-h", "conv", "mlstm-C-double", "mamba2-h-int"])
def test_16bit_small_states_are_rejected(op_name, name, make_bad, match):
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    args[name] = make_bad(args[name])
    with pytest.raises(ValueError, match=match):
        OPS[op_name][0](**args, **slot_args(op_name, [0, 2]))


@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("rounding,match", [
    ((torch.zeros(3, dtype=torch.int64), 1), r"rounding counter must be an int32 \[3\] tensor"),
    ((torch.zeros(4, dtype=torch.int32), 1), r"counter must be an int32 \[3\] tensor .* got torch.int32 \[4\]"),
    ((torch.zeros(3, 1, dtype=torch.int32), 1), r"rounding counter must be an int32 \[3\] tensor"),
    ((torch.zeros(3, dtype=torch.int32), -2), r"rounding salt must be an int in \[0, 2\*\*31\)"),
    ("stochastic", "rounding must be None, 'nearest' or StochasticRounding"),
], ids=["counter-dtype", "counter-length", "counter-rank", "salt", "mode"])
def test_bad_rounding_is_rejected(op_name, rounding, match):
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    args[MATRIX[op_name]] = args[MATRIX[op_name]].half()
    with pytest.raises(ValueError, match=match):
        OPS[op_name][0](**args, **slot_args(op_name, [0, 2]), rounding=rounding)


@pytest.mark.parametrize("op_name,name,make_bad,match", [
    ("mlstm_step", "C", lambda t: t.transpose(2, 3), "each slot's state must be contiguous"),
    ("mlstm_step", "n", lambda t: t[:, :, :1].expand(-1, -1, 24), "each slot's state must be contiguous"),
    ("mlstm_step", "C", lambda t: t.as_strided(t.shape, (t[0].numel() // 2, *t.stride()[1:])), "slots overlap"),
    ("retention_step", "offset", lambda t: t[:1].expand(3), "offset's slots overlap"),
    ("slstm_step", "m", lambda t: torch.stack([t, t], -1)[..., 0], "each slot's state must be contiguous"),
], ids=["inner-transposed", "inner-expanded", "slot-stride-too-small", "slots-expanded", "inner-strided"])
def test_bad_slot_layout_is_rejected(op_name, name, make_bad, match):
    op = OPS[op_name][0]
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    args[name] = make_bad(args[name])
    with pytest.raises(ValueError, match=match):
        op(**args, **slot_args(op_name, [0, 2]))


# ---------------------------------------------------------------------------------------------------------
# GPU, full model sizes

@cuda_only
@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("live_rows", [1, 20])
def test_gpu_half_state_full_size(op_name, dtype, stochastic, live_rows):
    check_half_state(op_name, dtype, stochastic, 0, "cuda", full=True, live=live_rows)


@cuda_only
@pytest.mark.parametrize("op_name", list(OPS))
def test_gpu_slot_major_full_size(op_name):
    check_slot_major(op_name, 0, "cuda", full=True)


@cuda_only
@pytest.mark.parametrize("op_name", list(MATRIX))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_gpu_stochastic_rounding_in_a_cuda_graph(op_name, dtype):
    """Captured once; the counter advances on the device between replays, and each replay rounds with it."""
    op, ref = OPS[op_name]
    matrix = MATRIX[op_name]
    slots = 8
    args, names, _ = case(op_name, 3, slots, full=True, device="cuda", seed=3)
    args[matrix] = args[matrix].to(dtype)
    rounding = StochasticRounding(torch.zeros(slots, dtype=torch.int32, device="cuda"), 5)
    rows_slots = slot_args(op_name, [5, 0, 2], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        op(**{**args, **{name: args[name].clone() for name in names}}, **rows_slots, rounding=rounding)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(**args, **rows_slots, rounding=rounding)
    for _ in range(2):
        rounding.counter.add_(1)  # the runner's increment, on the device
        # the reference steps from the state this replay starts from: kernel and reference states left to
        # evolve apart would differ by more than a step's rounding (10 of 6.3 million values of C on an H100)
        ref_args = {**args, **{name: args[name].clone() for name in names}}
        graph.replay()
        expected = ref(**ref_args, **rows_slots, rounding=rounding)
        assert_close(out, expected)
        assert_within_one_ulp(args[matrix], ref_args[matrix], matrix)
