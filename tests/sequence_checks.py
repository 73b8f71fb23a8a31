"""Shared checks of the state ops over a step's sequences (kernels/_common.py: seq_slots, seq_starts): sequences of
several rows beside empty ones and padding rows, against the op's reference, against row-at-a-time calls (bit for
bit), and with 16-bit matrix state rounded once per sequence. Used by the per-kernel test files."""
import torch

from kernels._common import plan
from kernels.state_rounding import StochasticRounding, round_ref, stochastic_bits_ref

PAD_SLOT = 0  # the engine's padding slot: the empty sequences that pad a step to its G point at it
# rows per sequence: a sequence of 2, an empty one with a slot of its own, 5, 1 (then empty ones at PAD_SLOT)
LENGTHS = (2, 0, 5, 1)


def bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(actual, expected, name=""):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    same = bits(actual) == bits(expected)
    assert same.all(), f"{name}: {(~same).sum().item()} of {same.numel()} differ"


def assert_within_ulps(actual, expected, name=""):
    """Equal up to a few ulps (NaN where NaN): for the Triton interpreter, where numpy sums a program's products in
    an order that follows the block's shape and the host's SIMD, which the GPU program fixes."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


class Layout:
    """A step of sequences of `lengths` rows on distinct random slots of a table, `empty_tail` empty sequences at
    PAD_SLOT after them, `padding_rows` rows past the last sequence, and `idle` slots no sequence names."""

    def __init__(self, lengths=LENGTHS, padding_rows=2, empty_tail=2, idle=2, device="cpu", seed=1):
        self.lengths = list(lengths)
        self.slots = 1 + len(lengths) + idle
        named = (torch.randperm(self.slots - 1, generator=torch.Generator().manual_seed(seed))[:len(lengths)] + 1)
        self.seq_slots, self.seq_starts = plan(named.tolist(), lengths, len(lengths) + empty_tail, device)
        self.live_rows = sum(lengths)
        self.rows = self.live_rows + padding_rows
        self.written = torch.tensor([s for s, n in zip(named.tolist(), lengths) if n], dtype=torch.long)
        self.device = device

    @property
    def plan(self):
        return dict(seq_slots=self.seq_slots, seq_starts=self.seq_starts)

    @property
    def unwritten(self):
        """Every slot no non-empty sequence names: PAD_SLOT, the empty sequence's own slot, the idle ones."""
        keep = torch.ones(self.slots, dtype=torch.bool)
        keep[self.written] = False
        return keep.nonzero().flatten()

    def positions(self):
        """Per row position j: the plan of the same G sequences with row j of those longer than j (the others
        empty), and those rows of the step."""
        lengths = self.lengths + [0] * (self.seq_slots.shape[0] - len(self.lengths))
        starts = self.seq_starts.tolist()
        for j in range(max(self.lengths)):
            rows = [starts[s] + j for s, n in enumerate(lengths) if n > j]
            seq_slots, seq_starts = plan(self.seq_slots.tolist(), [int(n > j) for n in lengths], None, self.device)
            yield dict(seq_slots=seq_slots, seq_starts=seq_starts), torch.tensor(rows, device=self.device)


def row_args(args, row_dims, rows):
    """args with each per-row input (name -> its row dimension in row_dims) cut to `rows`."""
    return {name: t.index_select(row_dims[name], rows) if name in row_dims else t for name, t in args.items()}


def clone_states(args, names):
    return {**args, **{name: args[name].clone() for name in names}}


def poison(args, names, slots):
    """The states of `slots` set to NaN (int32: a huge value), so that a stray read shows in the outputs."""
    for name in names:
        args[name][slots] = 2**30 if args[name].dtype == torch.int32 else float("nan")


def by_rows(op, args, row_dims, layout, after_row=None, **extra):
    """op called once per row position (Layout.positions) on args' tables; the live rows' outputs gathered in step
    order. after_row(args, out, rows, plan) runs after each call (slstm_step: the caller's store of y)."""
    out = None
    for sub_plan, rows in layout.positions():
        o = op(**row_args(args, row_dims, rows), **sub_plan, **extra)
        if out is None:
            out = torch.zeros(layout.rows, *o.shape[1:], dtype=o.dtype, device=o.device)
        out[rows] = o
        if after_row:
            after_row(args, o, rows, sub_plan)
    return out


def check_against_row_at_a_time(op, args, state_names, row_dims, layout, after_row=None, whole_extra=None,
                                same=assert_same_bits, **extra):
    """One call over the whole step (with whole_extra too) equals, bit for bit (or as `same` says), one call per row
    position: the live rows' outputs and every slot of every state table."""
    whole = clone_states(args, state_names)
    rows = clone_states(args, state_names)
    out = op(**whole, **layout.plan, **extra, **(whole_extra or {}))
    if after_row:
        after_row(whole, out, None, layout.plan)
    expected = by_rows(op, rows, row_dims, layout, after_row, **extra)
    live = slice(0, layout.live_rows)
    same(out[live], expected[live], "output")
    for name in state_names:
        same(whole[name], rows[name], name)


def check_against_reference(op, ref, args, state_names, layout, assert_close, **extra):
    """The op against its reference over the whole step: live rows' outputs and the written slots' states close,
    every other slot (the padding slot, an empty sequence's, idle ones) bit for bit untouched."""
    got, want = clone_states(args, state_names), clone_states(args, state_names)
    out = op(**got, **layout.plan, **extra)
    expected = ref(**want, **layout.plan, **extra)
    live = slice(0, layout.live_rows)
    assert out.dtype == torch.float32 and out.shape[0] == layout.rows
    assert torch.isfinite(out[live]).all()
    assert_close(out[live], expected[live])
    written, unwritten = layout.written.to(layout.device), layout.unwritten.to(layout.device)
    for name in state_names:
        if got[name].dtype == torch.int32:
            assert torch.equal(got[name][written], want[name][written]), name
        else:
            assert_close(got[name][written].float(), want[name][written].float())
        assert_same_bits(got[name][unwritten], args[name][unwritten], f"{name} outside the sequences' slots")
        assert_same_bits(want[name][unwritten], args[name][unwritten], f"{name} (reference) outside the slots")


def check_half_state(op, args, state_names, matrix, layout, dtype, stochastic, assert_alike, ref=None,
                     assert_within_one_ulp=None):
    """A 16-bit matrix state over the step's sequences: the readouts equal those of the same op on the widened fp32
    state (the state stays fp32 on chip through a sequence's rows), and each written slot's stored state is that
    fp32 run's final state rounded once, by round_ref seeded from the slot's counter; the small states equal the
    fp32 run's; every other slot and the counter are untouched. assert_alike: bit for bit on the CPU, within
    fp32 rounding on a GPU (tests/test_state_storage.py). With `ref`, also the reference from the same 16-bit
    state: readouts close, stored state within one ulp."""
    half = clone_states(args, state_names)
    half[matrix] = args[matrix].to(dtype)
    fp32 = clone_states(half, state_names)
    fp32[matrix] = half[matrix].float()
    initial = clone_states(half, state_names)
    counter = torch.randint(-2**31, 2**31 - 1, (layout.slots,), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(2)).to(layout.device)
    counter_before = counter.clone()
    rounding = StochasticRounding(counter, 1234) if stochastic else "nearest"
    out = op(**half, **layout.plan, rounding=rounding)
    out32 = op(**fp32, **layout.plan)
    live = slice(0, layout.live_rows)
    assert_alike(out[live], out32[live], "readout")
    written, unwritten = layout.written.to(layout.device), layout.unwritten.to(layout.device)
    noise = stochastic_bits_ref(rounding, written, half[matrix].shape[1:]) if stochastic else None
    assert_alike(half[matrix][written], round_ref(fp32[matrix][written], dtype, noise), matrix)
    for name in state_names:
        if name != matrix:
            assert_alike(half[name][written], fp32[name][written], name)
        assert_same_bits(half[name][unwritten], initial[name][unwritten], f"{name} outside the sequences' slots")
    assert torch.equal(counter, counter_before)
    if ref is not None:
        want = clone_states(initial, state_names)
        expected = ref(**want, **layout.plan, rounding=rounding)
        torch.testing.assert_close(out[live], expected[live], rtol=2e-5, atol=2e-5 * expected[live].abs().max().item())
        assert_within_one_ulp(half[matrix][written], want[matrix][written], matrix)
