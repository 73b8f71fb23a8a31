"""How the state kernels store state: every state kernel on slot-major tables (each component a strided view of
one byte buffer [S, slot bytes]).

Triton cases run on a GPU when there is one, else under the interpreter in a child process (see
tests/test_kernels.py); references and bad input run here; full-size cases need a GPU.
"""
import pytest
import torch

import kernels
from kernels._common import INTERPRET
from test_kernels import SMALL_DIMS, STATE_OPS, make_args
from triton_interpreter import run_under_interpreter

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")

OPS = {name: (op, ref) for name, (op, ref, _) in STATE_OPS.items()}
OPS.update(mlstm_input=(kernels.mlstm_input, kernels.mlstm_input_ref),
           slstm_input=(kernels.slstm_input, kernels.slstm_input_ref),
           slstm_output=(kernels.slstm_output, kernels.slstm_output_ref))
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


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def case(op_name, rows, slots, dims=None, seed=0, device=DEVICE):
    """(arguments without slot_ids, state names, names of the states the op writes) for one call."""
    if op_name in STATE_OPS:
        args = make_args(op_name, rows, slots, dims or SMALL_DIMS[op_name][0], device=device, seed=seed)
        names = STATE_OPS[op_name][2]
        return args, names, tuple(n for n in names if (op_name, n) != ("slstm_step", "y"))  # y: read only
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    if op_name == "mlstm_input":
        inner, gates = 72, 4
        args = dict(xm=randn(rows, inner), conv_state=randn(slots, inner, 3), conv_weight=randn(inner, 4) * 0.5,
                    conv_bias=randn(inner), qkv_weight=randn(inner // 4, 3, 4, 4) * 0.5,
                    gate_weight=randn(gates, 3 * inner) / inner**0.5, gate_bias=randn(gates))
        return args, ("conv_state",), ("conv_state",)
    if op_name == "slstm_input":
        width = 40
        args = dict(x=randn(rows, width), delta=randn(rows, width), bias=randn(width),
                    norm_weight=randn(width).abs() + 0.5, rms_eps=1e-6, ln_weight=randn(width).abs() + 0.5,
                    conv_state=randn(slots, width, 3), conv_weight=randn(width, 4), conv_bias=randn(width))
        return args, ("conv_state",), ("conv_state",)
    if op_name == "slstm_output":
        width = 48
        args = dict(y=randn(rows, width), xin=randn(rows, width), gn_weight=randn(width), gn_bias=randn(width),
                    ln_weight=randn(width), groups=4, out_dtype=torch.float32, y_state=randn(slots, width))
        return args, ("y_state",), ("y_state",)
    raise KeyError(op_name)


def run(op, args, tables, slot_ids):
    """op on copies of the inputs (slstm_input updates x in place), with `tables` as its states."""
    call = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return as_tuple(op(**call, **tables, slot_ids=slot_ids))


def layout(live, padding, idle, device, seed=1):
    """Slot ids: live rows on distinct random slots, padding rows on the last slot; and those live slots."""
    slots = live + idle + 1
    live_slots = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))[:live]
    slot_ids = torch.cat([live_slots, torch.full((padding,), slots - 1)]).to(torch.int32).to(device)
    return slots, slot_ids, live_slots.to(device)


def poison_padding_slot(tables, pad):
    for t in tables.values():
        t[pad] = 2**30 if t.dtype == torch.int32 else float("nan")


def assert_only_written(buf, before, regions, written, slot_ids):
    """Bytes change only in the written components of the rows' slots."""
    allowed = torch.zeros_like(buf, dtype=torch.bool)
    for name in written:
        start, stop = regions[name]
        allowed[slot_ids.long(), start:stop] = True
    changed = buf != before
    assert not (changed & ~allowed).any(), f"{(changed & ~allowed).sum().item()} bytes written outside the rows' states"


# ---------------------------------------------------------------------------------------------------------
# Slot-major tables: every state kernel, bit for bit as on contiguous tables

def check_slot_major(op_name, impl, device):
    op = OPS[op_name][impl]
    live = 3
    slots, slot_ids, live_slots = layout(live, padding=2, idle=3, device=device)
    args, names, written = case(op_name, len(slot_ids), slots, device=device)
    tables = {name: args.pop(name) for name in names}
    poison_padding_slot(tables, slots - 1)
    buf, views, regions = slot_major(tables, slots)
    before = buf.clone()
    contiguous = {name: t.clone() for name, t in tables.items()}
    for got, want in zip(run(op, args, views, slot_ids), run(op, args, contiguous, slot_ids)):
        assert_same_bits(got, want, "output")
    kept = torch.ones(slots, dtype=torch.bool, device=device)
    kept[-1] = False  # the padding slot: padding rows race on it
    for name in names:
        assert_same_bits(views[name][kept], contiguous[name][kept], name)
    assert_only_written(buf, before, regions, written, slot_ids)


def check_distinct_slot_strides(op_name, impl, device):
    """Each state a view of its own wider table, so that every state has its own slot stride."""
    op = OPS[op_name][impl]
    slots, slot_ids, _ = layout(3, padding=0, idle=2, device=device)
    args, names, _ = case(op_name, len(slot_ids), slots, device=device)
    tables = {name: args.pop(name) for name in names}
    views = {}
    for i, (name, t) in enumerate(tables.items()):
        wide = torch.full((slots, t[0].numel() + 8 * (i + 1)), float("nan"), device=device).to(t.dtype)
        views[name] = wide[:, 4 * (i + 1):4 * (i + 1) + t[0].numel()].view(t.shape)
        views[name].copy_(t)
    assert len({v.stride(0) for v in views.values()}) == len(views)
    for got, want in zip(run(op, args, views, slot_ids), run(op, args, tables, slot_ids)):
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


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter():
    run_under_interpreter(__file__, "triton_small")


@pytest.mark.parametrize("op_name", list(OPS))
def test_reference_slot_major(op_name):
    check_slot_major(op_name, 1, "cpu")


@runs_triton
@pytest.mark.parametrize("op_name", list(OPS))
def test_triton_small_slot_major(op_name):
    check_slot_major(op_name, 0, DEVICE)


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
        op(**args, slot_ids=torch.tensor([0, 2], dtype=torch.int32))
