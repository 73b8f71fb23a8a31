"""Tests of the state-step kernels (kernels/).

Three layers:
- each PyTorch reference against a plain float64 computation of docs/model/'s equations for one row;
- each Triton kernel against its reference, on the CPU through the Triton interpreter. Triton fixes the
  interpreter choice when it is imported and @triton.jit decorates, so those cases run in a child pytest
  process with TRITON_INTERPRET=1 (test_triton_under_interpreter) and are skipped here;
- the same comparisons at full model sizes on a GPU, plus CUDA graph capture (skipped without CUDA).
"""
import importlib
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan

HAS_CUDA = torch.cuda.is_available()

# Ops with slot-indexed state: (op, reference, state argument names)
STATE_OPS = {
    "causal_conv_update": (kernels.causal_conv_update, kernels.causal_conv_update_ref, ("conv_state",)),
    "mamba2_state_update": (kernels.mamba2_state_update, kernels.mamba2_state_update_ref, ("h",)),
    "retention_step": (kernels.retention_step, kernels.retention_step_ref, ("S", "scale", "offset")),
    "mlstm_step": (kernels.mlstm_step, kernels.mlstm_step_ref, ("C", "n", "m")),
    # y is read (the gate maps' state input), never written: slstm_output stores the new y
    "slstm_step": (kernels.slstm_step, kernels.slstm_step_ref, ("c", "n", "m", "y")),
    "rglru_step": (kernels.rglru_step, kernels.rglru_step_ref, ("h",)),
}
# Small, deliberately non-power-of-two sizes for the interpreter; the model's sizes for the GPU.
SMALL_DIMS = {
    "causal_conv_update": [dict(channels=37), dict(channels=300)],
    "mamba2_state_update": [dict(heads=3, head_dim=6, state_dim=10, hidden=20),
                            dict(heads=2, head_dim=20, state_dim=24, hidden=300)],
    "retention_step": [dict(heads=3, head_dim=10), dict(heads=2, head_dim=72)],
    "mlstm_step": [dict(heads=2, head_dim=24), dict(heads=1, head_dim=300)],
    "slstm_step": [dict(blocks=4, size=12), dict(blocks=2, size=40)],
    "rglru_step": [dict(width=50), dict(width=700)],
}
FULL_DIMS = {
    "causal_conv_update": dict(channels=4096),
    "mamba2_state_update": dict(heads=64, head_dim=64, state_dim=128, hidden=2048),
    "retention_step": dict(heads=8, head_dim=256),
    "mlstm_step": dict(heads=8, head_dim=512),
    "slstm_step": dict(blocks=4, size=512),
    "rglru_step": dict(width=2048),
}


def _rotary_angle(head_dim, device=None):
    half = head_dim // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=device) / max(half - 1, 1))
    return inv_freq.repeat_interleave(2)


def slot_args(op_name, live_slots, padding_rows=0, padding_slot=0, device="cpu"):
    """The slots of one row per live slot and then padding rows, as op_name takes them: slot_ids, the padding rows
    on padding_slot; or seq_slots and seq_starts, a one-row sequence per live slot, then an empty sequence at
    padding_slot per padding row (as the engine pads a step), the padding rows after the last sequence."""
    live_slots = [int(s) for s in live_slots]
    seq_slots, seq_starts = plan(live_slots + [padding_slot] * padding_rows,
                                 [1] * len(live_slots) + [0] * padding_rows, device=device)
    return dict(seq_slots=seq_slots, seq_starts=seq_starts)


def make_args(op_name, rows, slots, dims, dtype=torch.float32, device="cpu", seed=0):
    """Keyword arguments for one call (the slots excluded: slot_args): fp32 states, inputs in `dtype`, values in the
    ranges the model produces (negative Mamba2 a, decays in (0, 1), positive normalisers...)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    def inp(t):
        return t.to(dtype)

    if op_name == "causal_conv_update":
        ch = dims["channels"]
        return dict(x=inp(randn(rows, ch)), conv_state=randn(slots, ch, 3), weight=inp(randn(ch, 4) * 0.5),
                    bias=inp(randn(ch)), activation="silu")
    if op_name == "mamba2_state_update":
        heads, head_dim, state_dim, hidden = dims["heads"], dims["head_dim"], dims["state_dim"], dims["hidden"]
        return dict(h=randn(slots, heads, head_dim, state_dim), x=inp(randn(rows, heads, head_dim)),
                    t=inp(randn(rows, hidden)), dt_weight=inp(randn(heads, hidden) * 2 / math.sqrt(hidden)),
                    dt_bias=inp(randn(heads)), a=inp(-(rand(heads) * 15 + 1)),
                    b=inp(randn(rows, state_dim)), c=inp(randn(rows, state_dim)), d=inp(randn(heads)))
    if op_name == "retention_step":
        heads, head_dim = dims["heads"], dims["head_dim"]
        return dict(S=randn(slots, heads, head_dim, head_dim), scale=rand(slots, heads) * 20 + 1,
                    offset=torch.randint(0, 3000, (slots,), generator=gen, device=device, dtype=torch.int32),
                    q=inp(randn(rows, heads, head_dim)), k=inp(randn(rows, heads, head_dim)),
                    v=inp(randn(rows, heads, head_dim)),
                    decay=inp(1 - 2.0 ** (-5 - torch.arange(heads, device=device, dtype=torch.float32))),
                    angle=inp(_rotary_angle(head_dim, device)))
    if op_name == "mlstm_step":
        heads, head_dim = dims["heads"], dims["head_dim"]
        return dict(C=randn(slots, heads, head_dim, head_dim), n=randn(slots, heads, head_dim),
                    m=randn(slots, heads), q=inp(randn(rows, heads, head_dim)), k=inp(randn(rows, heads, head_dim)),
                    v=inp(randn(rows, heads, head_dim)), ip=inp(randn(rows, heads) * 2), fp=inp(randn(rows, heads) * 2))
    if op_name == "slstm_step":
        blocks, size = dims["blocks"], dims["size"]
        width = blocks * size
        weight = (randn(2, 4, blocks, size, size) / math.sqrt(2 * size)).to(torch.float16)  # as the engine's
        return dict(xc=inp(randn(rows, width)), xn=inp(randn(rows, width)), weight=weight,
                    bias=randn(4, width) * 0.5, c=randn(slots, width), n=rand(slots, width) + 0.5,
                    m=randn(slots, width), y=randn(slots, width))
    if op_name == "rglru_step":
        width = dims["width"]
        return dict(gate_pre=inp(randn(rows, width)), u=inp(randn(rows, width)), i_pre=inp(randn(rows, width)),
                    r_pre=inp(randn(rows, width)), a=inp(rand(width) * 0.15 + 0.85), h=randn(slots, width))
    raise KeyError(op_name)


def slot_kwargs(op_name, slot_ids):
    """slot_args for one row per slot of the int32 tensor slot_ids, on its device."""
    return slot_args(op_name, slot_ids.tolist(), device=slot_ids.device)


def assert_close(actual, expected, rtol=2e-5):
    """fp32 agreement, the absolute part scaled by the largest expected magnitude (sums of many terms)."""
    atol = rtol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def check_against_reference(op_name, live_rows, dims, dtype=torch.float32, device="cpu", padding_rows=0,
                            steps=2, seed=0, state_init=None):
    """Run `op` and its reference side by side for a few steps on copies of one state table.

    Live rows use distinct random slots; padding rows all share the last slot, which starts poisoned
    (NaN, or a huge offset) and is never compared. Outputs of live rows and the states of their slots
    must agree; slots that no row names must stay bit-for-bit unchanged, and for an op taking sequences (whose
    padding rows touch no state) the padding slot too.
    """
    op, ref, state_names = STATE_OPS[op_name]
    untouched = 3
    slots = live_rows + untouched + 1
    padding_slot = slots - 1
    gen = torch.Generator().manual_seed(seed + 1)
    live_slots = torch.randperm(slots - 1, generator=gen)[:live_rows]
    plan_args = slot_args(op_name, live_slots, padding_rows, padding_slot, device)
    args = make_args(op_name, live_rows + padding_rows, slots, dims, dtype, device, seed)
    if state_init:
        state_init(args)
    for name in state_names:
        args[name][padding_slot] = 2**30 if args[name].dtype == torch.int32 else float("nan")
    initial = {name: args[name].clone() for name in state_names}
    ref_args = {**args, **{name: args[name].clone() for name in state_names}}
    for _ in range(steps):
        out = op(**args, **plan_args)
        expected = ref(**ref_args, **plan_args)
        assert out.dtype == torch.float32
        assert torch.isfinite(out[:live_rows]).all()
        assert_close(out[:live_rows], expected[:live_rows])
    written = torch.zeros(slots, dtype=torch.bool)
    written[live_slots] = True
    for name in state_names:
        live = live_slots.to(device)
        if args[name].dtype == torch.int32:
            assert torch.equal(args[name][live], ref_args[name][live]), name
        else:
            assert_close(args[name][live], ref_args[name][live])
        idle = (~written).nonzero().flatten().to(device)
        assert torch.equal(_bits(args[name][idle]), _bits(initial[name][idle])), \
            f"{name}: a slot no row names was written"


def _bits(t):
    """Bit patterns, so that a NaN-poisoned slot compares equal to itself."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _slstm_fresh_state(args):
    """The sLSTM's initial state: c = n = y = 0, m = -inf."""
    for name in ("c", "n", "y"):
        args[name].zero_()
    args["m"].fill_(float("-inf"))


# ---------------------------------------------------------------------------------------------------
# Triton kernels vs references at small sizes: on the GPU when there is one, else under the interpreter
# in a child process (see module docstring)

RUNS_TRITON = INTERPRET or HAS_CUDA
TRITON_DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")


INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


CASES = [(op_name, dims) for op_name, dim_list in SMALL_DIMS.items() for dims in dim_list]


@runs_triton
@pytest.mark.parametrize("op_name,dims", CASES, ids=[f"{o}-{'x'.join(map(str, d.values()))}" for o, d in CASES])
@pytest.mark.parametrize("live_rows,padding_rows", [(1, 0), (3, 2)])
def test_triton_small_matches_reference(op_name, dims, live_rows, padding_rows):
    check_against_reference(op_name, live_rows, dims, device=TRITON_DEVICE, padding_rows=padding_rows)


@runs_triton
@pytest.mark.parametrize("op_name", list(STATE_OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_small_half_inputs(op_name, dtype):
    check_against_reference(op_name, 2, SMALL_DIMS[op_name][0], dtype=dtype, device=TRITON_DEVICE, padding_rows=1)


@runs_triton
def test_triton_small_slstm_first_step_from_minus_inf():
    check_against_reference("slstm_step", 3, dict(blocks=4, size=12), device=TRITON_DEVICE, padding_rows=2,
                            state_init=_slstm_fresh_state)


@runs_triton
def test_triton_small_slstm_step_leaves_y_to_slstm_output():
    """slstm_step reads y[slots] for the gate maps and leaves it; slstm_output stores the new y there."""
    args = make_args("slstm_step", 3, 5, dict(blocks=2, size=40), device=TRITON_DEVICE)
    y_before = args["y"].clone()
    slot_ids = torch.tensor([4, 0, 2], dtype=torch.int32, device=TRITON_DEVICE)
    sequences = slot_kwargs("slstm_step", slot_ids)
    y_new = kernels.slstm_step(**args, **sequences)
    assert torch.equal(args["y"], y_before)
    width = y_new.shape[1]
    xin, ones = torch.randn(3, width, device=TRITON_DEVICE), torch.ones(width, device=TRITON_DEVICE)
    s_out, _ = kernels.slstm_output(y_new, xin, ones, ones * 0, ones, 4, torch.float32, args["y"], **sequences)
    s_ref, _ = kernels.slstm_output_ref(y_new, xin, ones, ones * 0, ones, 4)
    assert torch.equal(args["y"][slot_ids.long()], y_new)
    assert torch.equal(args["y"][[1, 3]], y_before[[1, 3]])
    assert_close(s_out, s_ref)


@runs_triton
def test_triton_small_mlstm_gates_as_partial_sums():
    """ip, fp given as [P, B, NH] parts (as mlstm_input returns them) act as their sum."""
    args = make_args("mlstm_step", 3, 5, dict(heads=2, head_dim=24), device=TRITON_DEVICE)
    parts = torch.randn(5, 2, 3, 2, device=TRITON_DEVICE)  # [P, ip/fp, B, NH]
    summed = {**args, "C": args["C"].clone(), "n": args["n"].clone(), "m": args["m"].clone(),
              "ip": parts[:, 0].sum(0), "fp": parts[:, 1].sum(0)}
    args.update(ip=parts[:, 0], fp=parts[:, 1])
    sequences = slot_kwargs("mlstm_step", torch.tensor([4, 0, 2], dtype=torch.int32, device=TRITON_DEVICE))
    assert_close(kernels.mlstm_step(**args, **sequences), kernels.mlstm_step_ref(**summed, **sequences))
    for name in ("C", "n", "m"):
        assert_close(args[name], summed[name])


@runs_triton
@pytest.mark.parametrize("op_name", ["mlstm_step", "retention_step"])
def test_triton_small_streams_state_in_several_chunks(op_name, monkeypatch):
    """Small tiles force the d loop over several chunks and several value-column tiles."""
    monkeypatch.setattr(importlib.import_module(f"kernels.{op_name}"), "MAX_TILE", 16 * 16)
    check_against_reference(op_name, 2, dict(heads=2, head_dim=40), device=TRITON_DEVICE, padding_rows=1)


@runs_triton
def test_triton_small_strided_inputs():
    """Inputs that are column slices of a wider fused projection output (row stride != width)."""
    rows, heads, head_dim = 3, 2, 24
    args = make_args("mlstm_step", rows, 5, dict(heads=heads, head_dim=head_dim), device=TRITON_DEVICE)
    fused = torch.randn(rows, 3 * heads * head_dim, device=TRITON_DEVICE)
    for j, name in enumerate(("q", "k", "v")):
        args[name] = fused[:, j * heads * head_dim:(j + 1) * heads * head_dim].unflatten(1, (heads, head_dim))
    ref_args = {**args, "C": args["C"].clone(), "n": args["n"].clone(), "m": args["m"].clone()}
    sequences = slot_kwargs("mlstm_step", torch.tensor([4, 0, 2], dtype=torch.int32, device=TRITON_DEVICE))
    assert_close(kernels.mlstm_step(**args, **sequences), kernels.mlstm_step_ref(**ref_args, **sequences))
    assert_close(args["C"], ref_args["C"])


@runs_triton
@pytest.mark.parametrize("heads,head_dim", [(3, 10), (2, 72)])
def test_triton_small_retnet_output(heads, head_dim):
    o = torch.randn(4, heads, head_dim, device=TRITON_DEVICE)
    g = torch.randn(4, 2 * heads * head_dim, device=TRITON_DEVICE)[:, ::2]  # a strided input is copied, not misread
    assert_close(kernels.retnet_output(o, g), kernels.retnet_output_ref(o, g))


# ---------------------------------------------------------------------------------------------------
# References vs plain float64 computations of docs/model/'s equations, one row

def _one_row(op_name, dims, state_init=None):
    """A single-row call on slot 1 of a 3-slot table: (reference output row, args before the call,
    args after the call)."""
    args = make_args(op_name, 1, 3, dims, seed=7)
    if state_init:
        state_init(args)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    _, ref, _ = STATE_OPS[op_name]
    out = ref(**args, **slot_args(op_name, [1]))
    return out[0], before, args


def _f64(t):
    return t.double()


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def test_causal_conv_reference_matches_equations():
    out, before, after = _one_row("causal_conv_update", dict(channels=9))
    s, x, w, b = _f64(before["conv_state"][1]), _f64(before["x"][0]), _f64(before["weight"]), _f64(before["bias"])
    expected = torch.empty(9, dtype=torch.float64)
    for ch in range(9):
        window = [s[ch, 0], s[ch, 1], s[ch, 2], x[ch]]
        value = sum(w[ch, j] * window[j] for j in range(4)) + b[ch]
        expected[ch] = value * _sigmoid(value)
    assert_close(out.double(), expected)
    assert torch.equal(after["conv_state"][1], torch.stack([s[:, 1], s[:, 2], x], 1).float())
    assert torch.equal(after["conv_state"][[0, 2]], before["conv_state"][[0, 2]])


def test_mamba2_reference_matches_equations():
    dims = dict(heads=2, head_dim=3, state_dim=5, hidden=7)
    out, before, after = _one_row("mamba2_state_update", dims)
    h, x = _f64(before["h"][1]), _f64(before["x"][0])
    b, c = _f64(before["b"][0]), _f64(before["c"][0])
    expected_h = torch.empty_like(h)
    expected_y = torch.empty(2, 3, dtype=torch.float64)
    for hd in range(2):
        dt_raw = sum(before["t"][0, k].item() * before["dt_weight"][hd, k].item() for k in range(7))
        dt = math.log1p(math.exp(dt_raw + before["dt_bias"][hd].item()))
        decay = math.exp(before["a"][hd].item() * dt)
        for p in range(3):
            for n in range(5):
                expected_h[hd, p, n] = decay * h[hd, p, n] + dt * x[hd, p] * b[n]
            expected_y[hd, p] = sum(c[n] * expected_h[hd, p, n] for n in range(5)) + before["d"][hd].item() * x[hd, p]
    assert_close(out.double(), expected_y)
    assert_close(after["h"][1].double(), expected_h)


def test_retention_reference_matches_equations():
    heads, head_dim = 2, 6
    out, before, after = _one_row("retention_step", dict(heads=heads, head_dim=head_dim))
    offset = before["offset"][1].item()
    theta = (torch.tensor(float(offset)) * before["angle"]).double()  # fp32 product, as docs/model/retnet.md says
    expected_o = torch.empty(heads, head_dim, dtype=torch.float64)
    for hd in range(heads):
        q, v = _f64(before["q"][0, hd]), _f64(before["v"][0, hd])
        k = _f64(before["k"][0, hd]) / math.sqrt(head_dim)

        def rotary(u):
            out_u = torch.empty_like(u)
            for j in range(head_dim // 2):
                a0, a1 = u[2 * j], u[2 * j + 1]
                out_u[2 * j] = a0 * math.cos(theta[2 * j]) - a1 * math.sin(theta[2 * j])
                out_u[2 * j + 1] = a1 * math.cos(theta[2 * j + 1]) + a0 * math.sin(theta[2 * j + 1])
            return out_u

        q_rot, k_rot = rotary(q), rotary(k)
        decay = before["decay"][hd].item()
        S = _f64(before["S"][1, hd]) * decay + torch.outer(k_rot, v)
        scale = before["scale"][1, hd].item() * decay + 1
        expected_o[hd] = (q_rot @ S) / math.sqrt(scale)
        assert_close(after["S"][1, hd].double(), S)
        assert after["scale"][1, hd].item() == pytest.approx(scale, rel=1e-6)
    assert after["offset"][1].item() == offset + 1
    assert torch.equal(after["offset"][[0, 2]], before["offset"][[0, 2]])
    assert_close(out.double(), expected_o)


def test_retnet_output_reference_matches_equations():
    o, g = torch.randn(2, 3, 8), torch.randn(2, 24)
    out = kernels.retnet_output_ref(o, g)
    for row in range(2):
        for hd in range(3):
            oh = o[row, hd].double()
            normed = oh / math.sqrt((oh * oh).mean().item() + 1e-6)
            gh = g[row, hd * 8:(hd + 1) * 8].double()
            assert_close(out[row, hd * 8:(hd + 1) * 8].double(), gh * _sigmoid(gh) * normed)


def test_mlstm_reference_matches_equations():
    heads, head_dim = 2, 5
    out, before, after = _one_row("mlstm_step", dict(heads=heads, head_dim=head_dim))
    for hd in range(heads):
        ip, fp, m = before["ip"][0, hd].item(), before["fp"][0, hd].item(), before["m"][1, hd].item()
        lf = -math.log1p(math.exp(-fp))
        m_new = max(ip, m + lf)
        i_gate, f_gate = math.exp(ip - m_new), math.exp(lf + m - m_new)
        q, v = _f64(before["q"][0, hd]), _f64(before["v"][0, hd])
        k = _f64(before["k"][0, hd]) / math.sqrt(head_dim)
        C = f_gate * _f64(before["C"][1, hd]) + i_gate * torch.outer(k, v)
        n = f_gate * _f64(before["n"][1, hd]) + i_gate * k
        den = max(abs(float(q @ n)), math.exp(-m_new)) + 1e-6
        assert_close(out[hd].double(), (q @ C) / den)
        assert_close(after["C"][1, hd].double(), C)
        assert_close(after["n"][1, hd].double(), n)
        assert after["m"][1, hd].item() == pytest.approx(m_new, rel=1e-6)


def _slstm_expected(before, blocks, size):
    """docs/model/xlstm.md's sLSTM cell for row 0 on slot 1, its gate maps written out per column (inputs rounded to
    the weights' fp16, as the op specifies)."""
    width = blocks * size
    expected = {name: torch.empty(width, dtype=torch.float64) for name in ("c", "n", "m", "y")}
    w = before["weight"].double()
    xc, xn, y = (before[name][row].half().double() for name, row in (("xc", 0), ("xn", 0), ("y", 1)))
    for j in range(width):
        h, r = divmod(j, size)
        span = slice(h * size, (h + 1) * size)
        i, f, z, o = (float(w[0, g, h, r] @ x[span] + w[1, g, h, r] @ y[span]) + before["bias"][g, j].item()
                      for g, x in enumerate((xc, xc, xn, xn)))
        c, n, m = (before[name][1, j].item() for name in ("c", "n", "m"))
        lf = m - math.log1p(math.exp(-f))
        m_new = max(i, lf)
        i_gate = math.exp(i - m_new)
        f_gate = 0.0 if lf == -math.inf else math.exp(lf - m_new)
        c = f_gate * c + i_gate * math.tanh(z)
        n = f_gate * n + i_gate
        for name, value in (("c", c), ("n", n), ("m", m_new), ("y", c / (n + 1e-6) / (1 + math.exp(-o)))):
            expected[name][j] = value
    return expected


@pytest.mark.parametrize("fresh", [False, True], ids=["running", "first-step"])
def test_slstm_reference_matches_equations(fresh):
    out, before, after = _one_row("slstm_step", dict(blocks=2, size=5), _slstm_fresh_state if fresh else None)
    expected = _slstm_expected(before, 2, 5)
    assert_close(out.double(), expected["y"])
    for name in ("c", "n", "m"):
        assert_close(after[name][1].double(), expected[name])
    assert torch.equal(after["y"], before["y"])
    if fresh:  # f' = 0 exactly: the old cell cannot leak in
        assert torch.isfinite(out).all()


def test_rglru_reference_matches_equations():
    out, before, after = _one_row("rglru_step", dict(width=6))
    for j in range(6):
        gate, u = before["gate_pre"][0, j].item(), before["u"][0, j].item()
        i = 1 / (1 + math.exp(-before["i_pre"][0, j].item()))
        r = 1 / (1 + math.exp(-before["r_pre"][0, j].item()))
        alpha = before["a"][j].item() ** (8.0 * r)
        h = alpha * before["h"][1, j].item() + math.sqrt(1 - alpha**2) * (i * u)
        gelu = 0.5 * gate * (1 + math.erf(gate / math.sqrt(2)))
        assert after["h"][1, j].item() == pytest.approx(h, rel=1e-5, abs=1e-6)
        assert out[j].item() == pytest.approx(gelu * h, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# Dispatch and bad input (CPU)

@pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 ops run the Triton kernel on the CPU")
@pytest.mark.parametrize("op_name", list(STATE_OPS))
def test_cpu_tensors_fall_back_to_reference(op_name):
    op, ref, state_names = STATE_OPS[op_name]
    args = make_args(op_name, 2, 4, SMALL_DIMS[op_name][0])
    ref_args = {**args, **{name: args[name].clone() for name in state_names}}
    slots = slot_args(op_name, [3, 1])
    assert torch.equal(op(**args, **slots), ref(**ref_args, **slots))
    for name in state_names:
        assert torch.equal(args[name], ref_args[name])


@pytest.mark.parametrize("op_name", list(STATE_OPS))
def test_zero_rows_is_a_no_op(op_name):
    op, _, state_names = STATE_OPS[op_name]
    args = make_args(op_name, 0, 2, SMALL_DIMS[op_name][0])
    before = {name: args[name].clone() for name in state_names}
    out = op(**args, **slot_args(op_name, []))
    assert out.shape[0] == 0
    for name in state_names:
        assert torch.equal(args[name], before[name])


def _bad(op_name, name, make_bad, match, error=ValueError):
    return pytest.param(op_name, name, make_bad, match, error, id=f"{op_name}-{name}-{match.split()[0]}")


BAD_INPUTS = [
    # shared checks, exercised through several ops
    _bad("mlstm_step", "C", lambda t: t.double(), "must be float32"),
    _bad("mlstm_step", "n", lambda t: t[:, :, :-1], r"must have shape \[3, 2, 24\]"),
    _bad("mlstm_step", "m", lambda t: t.t().contiguous().t(), "must be contiguous"),
    _bad("mlstm_step", "m", lambda t: t.to("meta"), "is on meta"),
    _bad("mlstm_step", "q", lambda t: t.long(), "must be float32, bfloat16 or float16"),
    _bad("mlstm_step", "ip", lambda t: t[:, :1], r"must have shape \[2, 2\]"),
    _bad("mlstm_step", "v", lambda t: t.to("meta"), "is on meta"),
    _bad("mlstm_step", "k", lambda t: t.tolist(), "must be a torch.Tensor", TypeError),
    _bad("mlstm_step", "C", lambda t: t[0], r"C must be a \[S, NH, E, E\] tensor"),
    _bad("slstm_step", "m", lambda t: None, "must be a torch.Tensor", TypeError),
    _bad("slstm_step", "c", lambda t: t[0], r"c must be a \[S, H\] tensor"),
    _bad("slstm_step", "xn", lambda t: t[:, :3], r"xn must have shape \[2, 48\]"),
    _bad("slstm_step", "weight", lambda t: t[0], r"weight must be a \[2, 4, NB, s, s\] tensor"),
    _bad("slstm_step", "weight", lambda t: t[:, :, :3], "do not cover the state width 48"),
    _bad("slstm_step", "bias", lambda t: t[:3], r"bias must have shape \[4, 48\]"),
    _bad("rglru_step", "h", lambda t: t[None], r"h must be a \[S, Hd\] tensor"),
    _bad("rglru_step", "a", lambda t: t[:-1], r"a must have shape \[50\]"),
    _bad("causal_conv_update", "activation", lambda t: "relu", "activation must be None or 'silu'"),
    _bad("causal_conv_update", "x", lambda t: t[0], r"x must be a \[B, C\] tensor"),
    _bad("causal_conv_update", "weight", lambda t: t[:, :3], r"weight must have shape \[37, 4\]"),
    _bad("causal_conv_update", "conv_state", lambda t: t[:, :, :2], r"conv_state must have shape \[\*, 37, 3\]"),
    _bad("mamba2_state_update", "h", lambda t: t[0], r"h must be a \[S, H, P, N\] tensor"),
    _bad("mamba2_state_update", "dt_weight", lambda t: t[:, :1], r"dt_weight must have shape \[3, 20\]"),
    _bad("mamba2_state_update", "t", lambda t: t[0], r"t must have shape \[2, \*\]"),
    _bad("mamba2_state_update", "dt_bias", lambda t: t[:2], r"dt_bias must have shape \[3\]"),
    _bad("retention_step", "S", lambda t: t[..., :-1, :-1], "head size D must be even"),
    _bad("retention_step", "S", lambda t: t[0], r"S must be a \[S, Hh, D, D\] tensor"),
    _bad("retention_step", "offset", lambda t: t.long(), "offset must be an int32 tensor"),
    _bad("retention_step", "offset", lambda t: t[:-1], r"offset must have shape \[3\]"),
    _bad("retention_step", "angle", lambda t: t[:-2], r"angle must have shape \[10\]"),
]


@pytest.mark.parametrize("op_name,name,make_bad,match,error", BAD_INPUTS)
def test_bad_input_is_rejected(op_name, name, make_bad, match, error):
    op, _, _ = STATE_OPS[op_name]
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    args[name] = make_bad(args[name])
    with pytest.raises(error, match=match):
        op(**args, **slot_args(op_name, [0, 2]))


@pytest.mark.parametrize("name,make_bad,match", [
    ("seq_slots", lambda s: s.long(), "seq_slots must be a one-dimensional int32 tensor"),
    ("seq_starts", lambda s: s[:2], "seq_starts must have one more entry than seq_slots"),
    ("seq_slots", lambda s: s.to("meta"), "seq_slots is on meta"),
    ("seq_starts", lambda s: s.tolist(), "seq_starts must be a torch.Tensor"),
    # a column of a wider plan: the kernels read it densely, the slots of other columns (past the table)
    ("seq_slots", lambda s: torch.stack([s, s + 7], 1)[:, 0], "seq_slots must be contiguous"),
    ("seq_starts", lambda s: torch.stack([s, s], 1)[:, 0], "seq_starts must be contiguous"),
], ids=["dtype", "length", "device", "list", "strided-slots", "strided-starts"])
@pytest.mark.parametrize("op_name", list(STATE_OPS))
def test_bad_plans_are_rejected(op_name, name, make_bad, match):
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    plan_args = slot_args(op_name, [0, 2])
    plan_args[name] = make_bad(plan_args[name])
    with pytest.raises((ValueError, TypeError), match=match):
        STATE_OPS[op_name][0](**args, **plan_args)


@pytest.mark.parametrize("slots,starts,match", [
    ([-1, 2], [0, 1, 2], r"seq_slots must lie in \[0, 3\)"),  # would index the table from its end
    ([1, 3], [0, 1, 2], r"seq_slots must lie in \[0, 3\)"),
    ([1, 1], [0, 1, 2], "differ between non-empty sequences"),  # one sequence's update would be lost
    ([1, 2], [0, 2, 1], "non-decreasing"),  # overlapping rows
    ([1, 2], [0, 1, 3], "at most the 2 rows"),
], ids=["negative-slot", "slot-past-table", "slot-twice", "decreasing", "past-rows"])
@pytest.mark.parametrize("op_name", list(STATE_OPS))
def test_references_reject_bad_plan_values(op_name, slots, starts, match):
    """The references (the ops without a GPU) read the plan on the host, so they check its values before writing."""
    _, ref, state_names = STATE_OPS[op_name]
    args = make_args(op_name, 2, 3, SMALL_DIMS[op_name][0])
    before = {name: args[name].clone() for name in state_names}
    seq_slots, seq_starts = (torch.tensor(t, dtype=torch.int32) for t in (slots, starts))
    with pytest.raises(ValueError, match=match):
        ref(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    for name in state_names:
        assert torch.equal(args[name], before[name]), name


@pytest.mark.parametrize("o_shape,g_shape,match", [
    ((2, 3, 4), (2, 11), r"g must have shape \[2, 12\]"),
    ((2, 12), (2, 12), r"o must be a \[B, Hh, D\] tensor"),
], ids=["g-width", "o-rank"])
def test_retnet_output_bad_input(o_shape, g_shape, match):
    with pytest.raises(ValueError, match=match):
        kernels.retnet_output(torch.randn(*o_shape), torch.randn(*g_shape))


# ---------------------------------------------------------------------------------------------------
# GPU, full model sizes

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("op_name", list(STATE_OPS))
@pytest.mark.parametrize("live_rows", [1, 3, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_full_size_matches_reference(op_name, live_rows, dtype):
    check_against_reference(op_name, live_rows, FULL_DIMS[op_name], dtype=dtype, device="cuda",
                            padding_rows=2, steps=2)


@cuda_only
def test_gpu_slstm_first_step_from_minus_inf():
    check_against_reference("slstm_step", 20, FULL_DIMS["slstm_step"], device="cuda", padding_rows=3,
                            state_init=_slstm_fresh_state)


@cuda_only
@pytest.mark.parametrize("live_rows", [1, 20])
def test_gpu_retnet_output(live_rows):
    o = torch.randn(live_rows, 8, 256, device="cuda")
    g = torch.randn(live_rows, 2048, device="cuda")
    assert_close(kernels.retnet_output(o, g), kernels.retnet_output_ref(o, g))


@cuda_only
@pytest.mark.parametrize("op_name", list(STATE_OPS))
def test_gpu_cuda_graph_replay(op_name):
    """Captured once, replayed with new slots written into the captured buffers, as an engine would (a step of
    several rows per sequence: tests/test_*_ragged.py)."""
    op, ref, state_names = STATE_OPS[op_name]
    rows, slots = 3, 8
    dims = dict(FULL_DIMS[op_name])
    args = make_args(op_name, rows, slots, dims, device="cuda", seed=3)
    ref_args = {**args, **{name: args[name].clone() for name in state_names}}
    slots = slot_args(op_name, [5, 0, 2], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        warm = {**args, **{name: args[name].clone() for name in state_names}}
        op(**warm, **slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(**args, **slots)
    for step_slots in ([5, 0, 2], [1, 7, 5]):
        for name, value in slot_args(op_name, step_slots, device="cuda").items():
            slots[name].copy_(value)
        graph.replay()
        expected = ref(**ref_args, **slots)
        assert_close(out, expected)
    for name in state_names:
        if args[name].dtype == torch.int32:
            assert torch.equal(args[name], ref_args[name])
        else:
            assert_close(args[name], ref_args[name])
