"""Shared launch rules and input checks for the state-step kernels.

Every state op follows one convention. State tensors are tables with a leading slot dimension. A step's rows
come grouped in sequences, one per symbol, each holding that symbol's requests of the step in arrival order (as
vLLM's query_start_loc groups a prefill's tokens):

    seq_slots  int32 [G]      the state slot of sequence s
    seq_starts int32 [G + 1]  sequence s owns rows seq_starts[s] .. seq_starts[s + 1] - 1 (non-decreasing)

A program per sequence loads its slot's state once, advances it through the sequence's rows in order with the
state held on chip, and stores it once, so a symbol's state is read and written once a step however many of its
requests the step carries. An empty sequence (seq_starts[s] == seq_starts[s + 1]) touches no state: a CUDA graph
captured for G sequences serves any step of at most G symbols. Rows from seq_starts[G] on are padding: they
belong to no sequence, touch no state, and the state ops leave their outputs unwritten (the row ops compute them
as any row; nothing mixes rows). Distinct non-empty sequences have distinct slots (the caller's contract).

A table may be a view of a slot-major buffer (each slot's whole state one block of bytes): its slot stride is
then that block, and only each slot's own tensor is dense. States are fp32, except that the large matrix states
may be stored in fp16/bf16 (kernels/state_rounding.py). Inputs may be fp32/bf16/fp16; all math is fp32.
"""
import math
import os

import torch

# Triton decides at decoration time whether @triton.jit builds an interpreted kernel, so the dispatcher
# must use the same snapshot of the environment, taken when this package is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Enough programs for two per SM on an H100 (132 SMs), so that a step of a single row still streams its
# state through every SM.
TARGET_PROGRAMS = 264

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton for CUDA tensors or under TRITON_INTERPRET=1; the PyTorch reference otherwise."""
    return INTERPRET or tensor.is_cuda


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def split_block(extent: int, outer_programs: int, max_block: int, min_block: int) -> int:
    """Largest power-of-two block (at most max_block) that splits `extent` finely enough that
    outer_programs * ceil(extent / block) reaches TARGET_PROGRAMS; never below min_block."""
    block = min(max_block, next_pow2(extent))
    while block > min_block and outer_programs * -(-extent // block) < TARGET_PROGRAMS:
        block //= 2
    return max(block, 1)


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _check_shape(name: str, t: torch.Tensor, shape) -> None:
    if t.dim() != len(shape) or any(s is not None and s != ts for s, ts in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {_shape_str(shape)}, got {list(t.shape)}")


def _dtype_names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _slot_dense(t: torch.Tensor) -> bool:
    """t[0] contiguous (strides of size-1 dims do not matter), for any number of slots."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_state(name: str, t: torch.Tensor, shape, device: torch.device, dtypes=(torch.float32,)) -> None:
    """A state table [S, ...] updated in place: dtype one of `dtypes`, on `device`, each slot's tensor dense
    at any slot stride (a view of a slot-major buffer) without overlapping the next slot's; None in shape =
    any size. Kernels take the slot stride from t.stride(0) and address within a slot as in a dense tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_shape(name, t, shape)
    if t.dtype not in dtypes:
        hint = " (16-bit storage is for the large matrix states only)" if t.dtype in FLOAT_DTYPES else ""
        raise ValueError(f"{name} is a state and must be {_dtype_names(dtypes)}, got {t.dtype}{hint}")
    if not _slot_dense(t):
        raise ValueError(f"{name} is updated in place and each slot's state must be contiguous (any slot stride), "
                         f"got strides {tuple(t.stride())} for shape {list(t.shape)}")
    per_slot = math.prod(t.shape[1:])
    if t.shape[0] > 1 and t.stride(0) < max(per_slot, 1):
        raise ValueError(f"{name}'s slots overlap: slot stride {t.stride(0)} < {per_slot} elements per slot")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other tensors")


def check_input(name: str, t: torch.Tensor, shape, device: torch.device) -> torch.Tensor:
    """A read-only input: float32/bf16/fp16 on `device`. Returns it with a unit last-dim stride (a copy
    only when needed) so kernels can take it through its leading strides."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_shape(name, t, shape)
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other tensors")
    return t if t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def check_plan(seq_slots: torch.Tensor, seq_starts: torch.Tensor, device: torch.device) -> int:
    """seq_slots int32 [G] and seq_starts int32 [G + 1], contiguous, on `device`; returns G. Values (slots in range,
    starts non-decreasing and within the rows) are the caller's contract: checking them would need a device->host
    sync (the references check them: sequences_of)."""
    for name, t in (("seq_slots", seq_slots), ("seq_starts", seq_starts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a one-dimensional int32 tensor, got {t.dtype} {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the other tensors")
        if not t.is_contiguous():  # the kernels index it as a dense array: a strided view read other slots and rows
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if seq_starts.shape[0] != seq_slots.shape[0] + 1:
        raise ValueError(f"seq_starts must have one more entry than seq_slots ({seq_slots.shape[0]} sequences), "
                         f"got {seq_starts.shape[0]}")
    return seq_slots.shape[0]


def plan(slots, lengths, sequences=None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_slots, seq_starts) for sequences of `lengths` rows at `slots`, padded with empty sequences to
    `sequences` (default: as many as given); rows follow in sequence order from 0."""
    slots, lengths = [int(s) for s in slots], [int(n) for n in lengths]
    if len(slots) != len(lengths) or any(n < 0 for n in lengths):
        raise ValueError(f"one non-negative length per slot, got {len(slots)} slots and lengths {lengths}")
    sequences = len(slots) if sequences is None else sequences
    if sequences < len(slots):
        raise ValueError(f"{len(slots)} sequences do not fit in {sequences}")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    starts += [starts[-1]] * (sequences - len(slots))
    seq_slots = slots + [0] * (sequences - len(slots))
    return (torch.tensor(seq_slots, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def sequences_of(seq_slots: torch.Tensor, seq_starts: torch.Tensor, rows: int, table_slots: int):
    """[(slot, first row, end row)] of the non-empty sequences, on the host: for the PyTorch references. The plan's
    values are checked here, where they are on the host anyway (the kernels take them on trust): else a negative
    slot indexes the table from its end, a slot named twice keeps one sequence's update, and starts that decrease
    overlap rows, each without an error."""
    starts, slots = seq_starts.tolist(), seq_slots.tolist()
    if starts[0] < 0 or starts[-1] > rows or any(end < begin for begin, end in zip(starts[:-1], starts[1:])):
        raise ValueError(f"seq_starts must be non-negative, non-decreasing and at most the {rows} rows, got {starts}")
    seqs = [(slot, begin, end) for slot, begin, end in zip(slots, starts[:-1], starts[1:]) if end > begin]
    live = [slot for slot, _, _ in seqs]
    if any(not 0 <= slot < table_slots for slot in slots) or len(set(live)) < len(live):
        raise ValueError(f"seq_slots must lie in [0, {table_slots}) and differ between non-empty sequences, got "
                         f"{slots} for seq_starts {starts}")
    return seqs


def row_positions(seq_slots: torch.Tensor, seq_starts: torch.Tensor, rows: int, table_slots: int):
    """The non-empty sequences by row position, on the host: for the PyTorch references, which apply the one-row
    math to row position j of every sequence longer than j at once; the plan checked against a step of `rows` rows
    and a table of `table_slots` slots (sequences_of). Returns (slots, positions): slots int64 [L]
    the state slots of the L non-empty sequences; positions a list over j of (which, rows), int64 tensors: which
    of the L sequences are longer than j, and their j-th rows. All on seq_starts' device."""
    seqs = sequences_of(seq_slots, seq_starts, rows, table_slots)
    slots, begins, ends = torch.tensor(seqs, dtype=torch.int64, device=seq_starts.device).view(-1, 3).unbind(1)
    lengths = ends - begins
    positions = []
    for j in range(max([end - begin for _, begin, end in seqs], default=0)):
        which = (lengths > j).nonzero().flatten()
        positions.append((which, begins[which] + j))
    return slots, positions

