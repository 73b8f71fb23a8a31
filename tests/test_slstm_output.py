"""kernels/slstm_output.py's store of the sLSTM's y over a step's sequences: each non-empty sequence's last row at
its slot, nothing for empty sequences or padding rows; the reference's store has no device->host sync (the
compiled step traces it). Triton cases run on a GPU when there is one, else under the interpreter in a child
process. (The norms: tests/test_xlstm_glue.py.)"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernels._common import INTERPRET, plan
from kernels.slstm_output import slstm_output, slstm_output_ref, store_last_rows
from sequence_checks import Layout, assert_same_bits, poison

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
WIDTH, GROUPS = 48, 4


def make(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y, xin = (torch.randn(layout.rows, WIDTH, generator=gen).to(layout.device) for _ in range(2))
    weights = [(torch.rand(WIDTH, generator=gen) + 0.5).to(layout.device) for _ in range(3)]
    y_state = torch.randn(layout.slots, WIDTH, generator=gen).to(layout.device)
    poison(dict(y_state=y_state), ("y_state",), layout.unwritten)
    return y, xin, weights, y_state


def check_store(impl, layout):
    y, xin, weights, y_state = make(layout)
    before = y_state.clone()
    s_out, xn = impl(y, xin, *weights, GROUPS, torch.float32, y_state, **layout.plan)
    s_ref, xn_ref = slstm_output_ref(y, xin, *weights, GROUPS)
    live = slice(0, layout.live_rows)
    torch.testing.assert_close(s_out[live], s_ref[live], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xn[live], xn_ref[live], rtol=1e-5, atol=1e-5)
    starts = layout.seq_starts.tolist()
    for s, slot in enumerate(layout.seq_slots.tolist()):
        if starts[s + 1] > starts[s]:
            assert_same_bits(y_state[slot], y[starts[s + 1] - 1], f"sequence {s}'s last y")
    unwritten = layout.unwritten.to(layout.device)
    assert_same_bits(y_state[unwritten], before[unwritten], "y_state outside the sequences' slots")


def test_reference_stores_each_sequence_last_row():
    check_store(slstm_output_ref, Layout(device="cpu"))


def test_reference_store_of_an_empty_step_changes_no_bit():
    layout = Layout(lengths=(0, 0), device="cpu")
    y, _, _, y_state = make(layout)
    before = y_state.clone()
    store_last_rows(y_state, y, *plan([3, 0], [0, 0], 4))
    assert_same_bits(y_state, before, "y_state")


def test_reference_store_of_an_empty_sequence_on_a_live_slot():
    """An empty sequence naming a written slot does not race with its store."""
    y, y_state = torch.randn(3, 8), torch.randn(4, 8)
    seq_slots, seq_starts = plan([2, 1, 2], [0, 3, 0], 5)
    seq_slots[1] = 2  # the live sequence on slot 2 too
    store_last_rows(y_state, y, seq_slots, seq_starts)
    assert torch.equal(y_state[2], y[2])


def test_reference_store_needs_no_host_sync():
    """Traced with fake tensors: a .tolist() or .item() on the plan would fail here (data-dependent)."""
    layout = Layout(device="cpu")
    y, _, _, y_state = make(layout)
    graph = make_fx(lambda *t: store_last_rows(*t) or t[0], tracing_mode="fake")(y_state, y, *layout.plan.values())
    assert any("index_put" in str(node.target) for node in graph.graph.nodes)


def test_state_and_sequences_go_together():
    layout = Layout(device="cpu")
    y, xin, weights, y_state = make(layout)
    with pytest.raises(ValueError, match="y_state, seq_slots and seq_starts go together"):
        slstm_output(y, xin, *weights, GROUPS, torch.float32, y_state, layout.seq_slots)
    with pytest.raises(ValueError, match="seq_starts must have one more entry"):
        slstm_output(y, xin, *weights, GROUPS, torch.float32, y_state, layout.seq_slots, layout.seq_starts[:-1])


INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("lengths,padding_rows,empty_tail", [((2, 0, 5, 1), 2, 2), ((1, 1, 1), 0, 0),
                                                             ((1, 0), 0, 6)], ids=["ragged", "one-row", "more-seqs"])
def test_triton_small_stores_each_sequence_last_row(lengths, padding_rows, empty_tail):
    """Also with more sequences than rows (programs past the rows store only) and one row per sequence."""
    check_store(slstm_output, Layout(lengths=lengths, padding_rows=padding_rows, empty_tail=empty_tail,
                                     device=DEVICE))
