"""Checks shared by the tests of the state ops that take a step's rows as sequences (seq_slots, seq_starts:
kernels/_common.py), each op described by a RaggedOp.

- against the reference: sequences of 2, 0, 5 and 1 rows in one call, with empty sequences at the padding slot
  after them and padding rows after the last sequence; outputs of the sequences' rows close, their slots'
  states close, every other slot (the empty sequence's, the padding slot, idle ones) bit for bit as before;
- against row-at-a-time calls: the same op called once per row position, each call holding the j-th row of every
  sequence longer than j as a one-row sequence (padded with empty sequences to the same number of sequences, so
  the same launch): outputs and states bit for bit equal (fp32 state);
- a CUDA graph captured for G sequences and R rows, replayed with other plans (other slots and lengths).
"""
from dataclasses import dataclass
from typing import Callable

import torch

from kernels._common import plan

PADDING_SLOT = 0
SLOTS = 8
# (slot, rows) of each sequence: one empty sequence on a slot of its own, which it must leave as it is
SEQUENCES = [(5, 2), (3, 0), (1, 5), (6, 1)]
TRAILING_EMPTY = 2  # empty sequences at the padding slot, as the engine pads a step to a captured G
PADDING_ROWS = 2


@dataclass
class RaggedOp:
    """op / ref: the op and its reference; make(rows, slots, seed, device) -> keyword arguments (states
    included, the plan excluded); states: names of the state tables; row_inputs: names of the per-row inputs
    ([B, ...] tensors), those updated in place included; outputs(result, kwargs) -> the per-row results, rows first
    (the in-place rows included)."""
    op: Callable
    ref: Callable
    make: Callable
    states: tuple
    row_inputs: tuple
    outputs: Callable


def assert_close(actual, expected, rtol=2e-5, name=""):
    """fp32 agreement, the absolute part scaled by the largest expected magnitude (sums of many terms); NaN
    where NaN is expected (the poisoned padding slot)."""
    atol = rtol * max(1.0, expected.nan_to_num().abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=name or None)


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]) if t.is_floating_point() else t


def assert_same_bits(actual, expected, name=""):
    assert torch.equal(bits(actual), bits(expected)), f"{name}: not bit for bit equal"


def poison(args, states, slot):
    for name in states:
        args[name][slot] = float("nan")


def layout(sequences=SEQUENCES, trailing_empty=TRAILING_EMPTY, padding_rows=PADDING_ROWS, device="cpu"):
    """(seq_slots, seq_starts, rows in all, first rows of the sequences) for (slot, length) sequences."""
    slots, lengths = zip(*sequences)
    seq_slots, seq_starts = plan(slots, lengths, len(sequences) + trailing_empty, device=device)
    starts = seq_starts.tolist()
    return seq_slots, seq_starts, starts[-1] + padding_rows, starts[:len(sequences)]


def live_rows(seq_starts):
    return torch.arange(int(seq_starts[-1]))


def written_slots(sequences=SEQUENCES):
    return sorted(slot for slot, n in sequences if n)


def check_kept(after, before, written, states, name=""):
    """Every slot outside `written` bit for bit as before."""
    for state in states:
        kept = [s for s in range(after[state].shape[0]) if s not in written]
        assert_same_bits(after[state][kept], before[state][kept], f"{name} {state}: a slot no sequence owns")


def clone_states(args, names):
    return {**args, **{name: args[name].clone() for name in names}}


def run(spec, fn, args, seq_slots, seq_starts, **extra):
    return spec.outputs(fn(**args, seq_slots=seq_slots, seq_starts=seq_starts, **extra), args)


def check_against_reference(spec, device, sequences=SEQUENCES, seed=0, extra=None, rtol=2e-5):
    """One call of op and reference on copies of a table; the sequences' rows and slots agree, nothing else in
    the table changes."""
    extra = extra or {}
    seq_slots, seq_starts, rows, _ = layout(sequences, device=device)
    args = spec.make(rows, SLOTS, seed, device)
    poison(args, spec.states, PADDING_SLOT)
    before = {name: args[name].clone() for name in spec.states}
    ref_args = clone_states(args, spec.states + spec.row_inputs)
    got = run(spec, spec.op, args, seq_slots, seq_starts, **extra)
    want = run(spec, spec.ref, ref_args, seq_slots, seq_starts, **extra)
    live = live_rows(seq_starts).to(device)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert torch.isfinite(g[live]).all()
        assert_close(g[live], w[live], rtol)
    written = written_slots(sequences)
    for name in spec.states:
        assert_close(args[name][written].float(), ref_args[name][written].float(), rtol)
    check_kept(args, before, written, spec.states, "op")
    check_kept(ref_args, before, written, spec.states, "reference")
    return args, ref_args


def row_at_a_time(spec, fn, args, sequences, trailing_empty, device, **extra):
    """fn called once per row position j with the j-th row of every sequence longer than j (a one-row sequence
    each), padded with empty sequences to as many sequences as `sequences` and trailing_empty give; updates the
    states of args in place and returns the per-row results, rows first (zeros where no call wrote)."""
    _, _, rows, firsts = layout(sequences, trailing_empty, device=device)
    count = len(sequences) + trailing_empty
    results = None
    for j in range(max(n for _, n in sequences)):
        active = [i for i, (_, n) in enumerate(sequences) if n > j]
        picked = torch.tensor([firsts[i] + j for i in active], device=device)
        call = {**args, **{name: args[name][picked] for name in spec.row_inputs}}
        seq_slots, seq_starts = plan([sequences[i][0] for i in active], [1] * len(active), count, device=device)
        out = run(spec, fn, call, seq_slots, seq_starts, **extra)
        if results is None:
            results = [torch.zeros(rows, *o.shape[1:], dtype=o.dtype, device=device) for o in out]
        for full, part in zip(results, out):
            full[picked] = part
    return results


def check_row_at_a_time(spec, impl, device, sequences=SEQUENCES, seed=0, extra=None, exact=True):
    """A call with multi-row sequences against row-at-a-time calls of the same function (impl 0: op, 1: reference):
    bit for bit (exact) or within fp32 rounding."""
    extra = extra or {}
    fn = (spec.op, spec.ref)[impl]
    seq_slots, seq_starts, rows, _ = layout(sequences, device=device)
    args = spec.make(rows, SLOTS, seed, device)
    poison(args, spec.states, PADDING_SLOT)
    before = {name: args[name].clone() for name in spec.states}
    single = clone_states(args, spec.states + spec.row_inputs)
    got = run(spec, fn, clone_states(args, spec.row_inputs), seq_slots, seq_starts, **extra)
    want = row_at_a_time(spec, fn, single, sequences, TRAILING_EMPTY, device, **extra)
    live = live_rows(seq_starts).to(device)
    compare = assert_same_bits if exact else assert_close
    for k, (g, w) in enumerate(zip(got, want)):
        compare(g[live], w[live], name=f"output {k}")
    for name in spec.states:
        compare(args[name], single[name], name=name)
    check_kept(args, before, written_slots(sequences), spec.states)


def check_cuda_graph(spec, dims_seed=3, extra=None):
    """Captured for 4 sequences and 8 rows, replayed with plans of other slots and lengths written into the
    captured plan tensors (as the engine does), against the reference stepping alongside."""
    extra = extra or {}
    count, rows = 4, 8
    args = spec.make(rows, SLOTS, dims_seed, "cuda")
    ref_args = clone_states(args, spec.states)
    seq_slots, seq_starts = plan([1, 2, 3, 4], [1, 1, 1, 1], count, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        spec.op(**clone_states(args, spec.states + spec.row_inputs), seq_slots=seq_slots, seq_starts=seq_starts,
                **extra)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    replay_args = clone_states(args, spec.row_inputs)  # the in-place rows restart from args at each replay
    with torch.cuda.graph(graph):
        out = run(spec, spec.op, replay_args, seq_slots, seq_starts, **extra)
    for slots, lengths in (([1, 2, 3, 4], [1, 1, 1, 1]), ([6, 2, 5], [3, 0, 4]), ([7], [8]), ([3, 1], [2, 1])):
        step_slots, step_starts = plan(slots, lengths, count, device="cuda")
        seq_slots.copy_(step_slots)
        seq_starts.copy_(step_starts)
        for name in spec.row_inputs:
            replay_args[name].copy_(args[name])
        graph.replay()
        call = clone_states(ref_args, spec.row_inputs)
        expected = run(spec, spec.ref, call, step_slots, step_starts, **extra)
        live = live_rows(step_starts).cuda()
        for g, w in zip(out, expected):
            assert_close(g[live], w[live])
        for name in spec.states:
            assert_close(replay_args[name].float(), ref_args[name].float())
