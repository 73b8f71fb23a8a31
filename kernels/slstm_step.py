"""One sLSTM step (xLSTM's scalar memory): the eight block-diagonal gate maps and the cell update in one pass.

Per head block h of size s (NB blocks over the width H = NB s), with y the previous output:
pre_g = W_g,in[h] x_g + W_g,state[h] y + b_g for g in (i, f, z, o), where i and f read xc, z and o read xn;
lf = m + logsigmoid(f); m_new = max(i, lf); i' = exp(i - m_new); f' = exp(lf - m_new);
c <- f' c + i' tanh(z); n <- f' n + i'; y_new = sigmoid(o) c / (n + 1e-6).
m starts at -inf: f' is then selected to be exactly 0 (never computed from -inf - -inf).

One program owns BLOCK_N columns of one head block for a tile of sequences and streams those columns' eight
weight slices once (16-bit tensor-core products with fp32 accumulation, x cast to the weights' dtype like cuBLAS),
then updates c, n, m for them. The products read y across a whole head block while other programs update
theirs, so y is the one state this op does not write: it returns y_new, and slstm_output stores each sequence's
last at its slot (kernels/slstm_output.py).

fp32 maps come split as in kernels/skinny_matmul.py (W = W_hi + W_lo / 2^11, two fp16 tensors, still 4 bytes a
weight): x (y_prev for the state maps) is split the same way in registers and each map takes three fp16 products,
x_hi W_hi + (x_hi W_lo + x_lo W_hi) / 2^11, about 22 bits of each. Only the input maps' rounding shows in the
predictions (bench/LOG.md section 34), so `auto` splits them over fp16 state maps; `fp32` splits both.

A sequence's rows run one launch per row position j < max_rows (kernels/_common.py's sequences): launch j advances
row j of every sequence longer than j, its y the state y for j = 0, else the previous row's output of this op, and
reads and writes c, n, m (one value per column) each time. A launch's tiles of sequences none of which is that
long return at once: a step captured for K rows a symbol carrying fewer would otherwise read the weights K times
(bench/LOG.md section 46: one symbol's 2 requests 3.91 ms at K = 8, 2.97 with the early return). A row's gate maps
need the previous row's whole y of a head block, which the block's column programs finish only together: a loop over
rows inside one launch would need those programs to wait on each other (a grid-wide barrier, which deadlocks unless
all are resident at once, not guaranteed beside the other towers' kernels), or one program per head block, 32 times
fewer programs at one row.

The input maps read no state, so a step of several rows a symbol takes them out of the row positions' launches:
one launch computes every row's x W_in + b first (reading the input maps once, their 16 MB split at the full
size, where each row position's launch read them again), and the launches of the row positions then read only
the state maps (8 MB) and that part of their rows. The input maps' launch is a GEMM's (the skinny kernel's tile
products, one gate and 64 columns a program); a step of one row a symbol keeps the one launch. Each part is summed
in an accumulator of its own, in one order on both paths, (x W_in + b) + y W_state, so the two agree to the bit
where the tensor cores sum alike (the interpreter, and an H100 at the tests' sizes). H100, a block's launches at 64
symbols (scripts/tile_sweep.py): 4 rows each 122 -> 74 us, 8 rows 230 -> 145 (bench/LOG.md section 51).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, next_pow2, row_positions, use_triton
from kernels._math import logsigmoid, sigmoid, tanh
from kernels.skinny_matmul import LO_SCALE, split_fp16, tile_products

Y_EPS = 1e-6
GATES = 4  # i, f, z, o
WEIGHT_DTYPES = (torch.float16, torch.bfloat16)
# Sequences a program: at 64 symbols one tile of 64 reads the weights once a launch, faster than two of 32 or four
# of 16 (bench/LOG.md section 49: 64x4 113 against 158 and 175 us)
MAX_BLOCK_M = 64
BLOCK_N = 16
BLOCK_K = 64
# Columns a program of the hoisted input maps (one gate's): a GEMM's tile, where the row positions' 16 columns
# carrying all four gates took 52 us a block at 64 x 4 rows (H100)
INPUT_BLOCK_N = 64


def pack_weights(input_maps, state_maps, input_dtype, state_dtype):
    """The BlockLinear weights [NB, s, s] (out, in) of the four input maps and the four state maps, each in
    gate order i, f, z, o -> the op's (weight [2, 4, NB, s, s], weight_lo): both in one 16-bit dtype and weight_lo
    None; fp32 input maps over fp16 state maps, split: weight[0] their high halves, weight_lo [4, NB, s, s] fp16
    their low ones; or all eight in fp32, split: weight all high halves, weight_lo [2, 4, NB, s, s] the low ones."""
    w_in, w_state = torch.stack(list(input_maps)), torch.stack(list(state_maps))
    if input_dtype == state_dtype == torch.float32:
        hi, lo = split_fp16(torch.stack([w_in, w_state]).float())
        return hi.contiguous(), lo.contiguous()
    if input_dtype == state_dtype:
        return torch.stack([w_in, w_state]).to(input_dtype).contiguous(), None
    if (input_dtype, state_dtype) != (torch.float32, torch.float16):
        raise ValueError(f"the sLSTM's maps take one dtype, or fp32 input maps and fp16 state maps; got "
                         f"{input_dtype} and {state_dtype}")
    hi, lo = split_fp16(w_in.float())
    return torch.stack([hi, w_state.to(torch.float16)]).contiguous(), lo.contiguous()


def _check(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows, weight_lo):
    if not isinstance(c, torch.Tensor) or c.dim() != 2:
        raise ValueError(f"c must be a [S, H] tensor, got {getattr(c, 'shape', type(c).__name__)}")
    slots, width = c.shape
    device = c.device
    for name, state in (("c", c), ("n", n), ("m", m), ("y", y)):
        check_state(name, state, (slots, width), device)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 5 or weight.shape[:2] != (2, GATES):
        raise ValueError(f"weight must be a [2, 4, NB, s, s] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    blocks, size = weight.shape[2], weight.shape[3]
    weight = check_input("weight", weight, (2, GATES, blocks, size, size), device).contiguous()
    if blocks * size != width:
        raise ValueError(f"weight's {blocks} blocks of {size} do not cover the state width {width}")
    if weight_lo is not None:  # the input maps' low halves, or both parts' ([2, 4, NB, s, s])
        both = isinstance(weight_lo, torch.Tensor) and weight_lo.dim() == 5
        lo_shape = (2, GATES, blocks, size, size) if both else (GATES, blocks, size, size)
        weight_lo = check_input("weight_lo", weight_lo, lo_shape, device).contiguous()
        if (weight.dtype, weight_lo.dtype) != (torch.float16, torch.float16):
            raise ValueError(f"split input maps are float16 halves (weight and weight_lo), got {weight.dtype} and "
                             f"{weight_lo.dtype}")
    rows = xc.shape[0] if isinstance(xc, torch.Tensor) and xc.dim() == 2 else None
    xc = check_input("xc", xc, (rows, width), device)
    xn = check_input("xn", xn, (rows, width), device)
    bias = check_input("bias", bias, (GATES, width), device).contiguous()
    check_plan(seq_slots, seq_starts, device)
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int (a bound on any sequence's length), got {max_rows!r}")
    return xc, xn, weight, bias, weight_lo


def slstm_step_ref(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows=1, weight_lo=None):
    """PyTorch reference of slstm_step, same signature and in-place semantics: the inputs rounded to the
    weights' dtype (split like the input maps where they are split), products and everything after them in fp32,
    row position by row position. A sequence longer than max_rows is an error here (the kernel cannot see it)."""
    xc, xn, weight, bias, weight_lo = _check(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows,
                                             weight_lo)
    rows, width = xc.shape
    blocks, size = weight.shape[2], weight.shape[3]
    out = torch.zeros(rows, width, device=xc.device, dtype=torch.float32)
    slots, positions = row_positions(seq_slots, seq_starts, rows, c.shape[0])
    if len(positions) > max_rows:
        raise ValueError(f"a sequence has {len(positions)} rows, more than max_rows={max_rows}")

    def blockwise(x, w):  # [R, H] through one [NB, s, s] (out, in) map
        x = x.to(weight.dtype).float().view(-1, blocks, size)
        return torch.einsum("bhk,hjk->bhj", x, w.float()).reshape(-1, width)

    lows = (None, None) if weight_lo is None else (weight_lo, None) if weight_lo.dim() == 4 else weight_lo

    def gate_map(x, part, g):  # part 0: the input maps, 1: the state maps
        if lows[part] is None:
            return blockwise(x, weight[part, g])
        x_hi, x_lo = split_fp16(x.float())
        lower = blockwise(x_hi, lows[part][g]) + blockwise(x_lo, weight[part, g])
        return blockwise(x_hi, weight[part, g]) + lower / LO_SCALE

    c_seq, n_seq, m_seq = c[slots], n[slots], m[slots]
    for j, (which, rs) in enumerate(positions):  # row position j of every sequence longer than j
        y_prev = y[slots[which]] if j == 0 else out[rs - 1]
        i, f, z, o = ((gate_map(x[rs], 0, g) + bias[g].float()) + gate_map(y_prev, 1, g)
                      for g, x in enumerate((xc, xc, xn, xn)))
        lf = m_seq[which] + F.logsigmoid(f)
        m_new = torch.maximum(i, lf)
        i_gate = torch.exp(i - m_new)
        f_gate = torch.where(lf == float("-inf"), torch.zeros_like(lf), torch.exp(lf - m_new))
        c_seq[which] = f_gate * c_seq[which] + i_gate * torch.tanh(z)
        n_seq[which] = f_gate * n_seq[which] + i_gate
        m_seq[which] = m_new
        out[rs] = torch.sigmoid(o) * c_seq[which] / (n_seq[which] + Y_EPS)
    c[slots], n[slots], m[slots] = c_seq, n_seq, m_seq
    return out


@triton.jit
def _gate_products(xc_ptr, xn_ptr, y_rows, r, r_mask, stride_xc, stride_xn, w_ptr, w_lo_ptr, block, j, j_mask, size,
                   gate_stride, INPUTS: tl.constexpr, STATES: tl.constexpr, SPLIT: tl.constexpr,
                   SPLIT_STATE: tl.constexpr, LO_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Rows r's gate products over one tile of a head block's columns j, each part in its own accumulator (so
    that either part comes out with the same bits alone as beside the other): the input maps' (x W_in, split
    where SPLIT; zero unless INPUTS) and the state maps' (y_prev W_state, y_prev at y_rows, split where
    SPLIT_STATE, their low halves at w_lo_ptr's maps 4-7; zero unless STATES), gates i, f, z, o."""
    in_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    in_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    in_z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    in_o = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the split's lower-order terms, x LO_SCALE
    low_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_o = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    st_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    st_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    st_z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    st_o = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_si = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the state maps' lower-order terms, x LO_SCALE
    low_sf = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_sz = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    low_so = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = (block * size + j)[:, None] * size  # offset of row j of block `block` in a map
    for k0 in range(0, size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < size
        col = block * size + k
        x_mask = r_mask[:, None] & k_mask[None, :]
        w = w_ptr + w_rows + k[None, :]
        w_mask = j_mask[:, None] & k_mask[None, :]
        if INPUTS:
            xc = tl.load(xc_ptr + r[:, None] * stride_xc + col[None, :], mask=x_mask, other=0.0)
            xn = tl.load(xn_ptr + r[:, None] * stride_xn + col[None, :], mask=x_mask, other=0.0)
            xc_hi = xc.to(w_ptr.dtype.element_ty)
            xn_hi = xn.to(w_ptr.dtype.element_ty)
            w_i = tl.load(w, mask=w_mask, other=0.0)
            in_i = tl.dot(xc_hi, tl.trans(w_i), in_i)
            w_f = tl.load(w + gate_stride, mask=w_mask, other=0.0)
            in_f = tl.dot(xc_hi, tl.trans(w_f), in_f)
            w_z = tl.load(w + 2 * gate_stride, mask=w_mask, other=0.0)
            in_z = tl.dot(xn_hi, tl.trans(w_z), in_z)
            w_o = tl.load(w + 3 * gate_stride, mask=w_mask, other=0.0)
            in_o = tl.dot(xn_hi, tl.trans(w_o), in_o)
            if SPLIT:  # x_hi W_lo + x_lo W_hi (x_lo W_lo dropped), each W_hi tile read once
                xc_lo = ((xc.to(tl.float32) - xc_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
                xn_lo = ((xn.to(tl.float32) - xn_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
                lo = w_lo_ptr + w_rows + k[None, :]
                low_i = tl.dot(xc_hi, tl.trans(tl.load(lo, mask=w_mask, other=0.0)), low_i)
                low_i = tl.dot(xc_lo, tl.trans(w_i), low_i)
                low_f = tl.dot(xc_hi, tl.trans(tl.load(lo + gate_stride, mask=w_mask, other=0.0)), low_f)
                low_f = tl.dot(xc_lo, tl.trans(w_f), low_f)
                low_z = tl.dot(xn_hi, tl.trans(tl.load(lo + 2 * gate_stride, mask=w_mask, other=0.0)), low_z)
                low_z = tl.dot(xn_lo, tl.trans(w_z), low_z)
                low_o = tl.dot(xn_hi, tl.trans(tl.load(lo + 3 * gate_stride, mask=w_mask, other=0.0)), low_o)
                low_o = tl.dot(xn_lo, tl.trans(w_o), low_o)
        if STATES:
            yp = tl.load(y_rows[:, None] + col[None, :], mask=x_mask, other=0.0)
            yp_hi = yp.to(w_ptr.dtype.element_ty)
            ws_i = tl.load(w + 4 * gate_stride, mask=w_mask, other=0.0)
            st_i = tl.dot(yp_hi, tl.trans(ws_i), st_i)
            ws_f = tl.load(w + 5 * gate_stride, mask=w_mask, other=0.0)
            st_f = tl.dot(yp_hi, tl.trans(ws_f), st_f)
            ws_z = tl.load(w + 6 * gate_stride, mask=w_mask, other=0.0)
            st_z = tl.dot(yp_hi, tl.trans(ws_z), st_z)
            ws_o = tl.load(w + 7 * gate_stride, mask=w_mask, other=0.0)
            st_o = tl.dot(yp_hi, tl.trans(ws_o), st_o)
            if SPLIT_STATE:  # as the input maps' split
                yp_lo = ((yp.to(tl.float32) - yp_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
                lo = w_lo_ptr + w_rows + k[None, :] + 4 * gate_stride
                low_si = tl.dot(yp_hi, tl.trans(tl.load(lo, mask=w_mask, other=0.0)), low_si)
                low_si = tl.dot(yp_lo, tl.trans(ws_i), low_si)
                low_sf = tl.dot(yp_hi, tl.trans(tl.load(lo + gate_stride, mask=w_mask, other=0.0)), low_sf)
                low_sf = tl.dot(yp_lo, tl.trans(ws_f), low_sf)
                low_sz = tl.dot(yp_hi, tl.trans(tl.load(lo + 2 * gate_stride, mask=w_mask, other=0.0)), low_sz)
                low_sz = tl.dot(yp_lo, tl.trans(ws_z), low_sz)
                low_so = tl.dot(yp_hi, tl.trans(tl.load(lo + 3 * gate_stride, mask=w_mask, other=0.0)), low_so)
                low_so = tl.dot(yp_lo, tl.trans(ws_o), low_so)
    if SPLIT:
        in_i += low_i * (1.0 / LO_SCALE)
        in_f += low_f * (1.0 / LO_SCALE)
        in_z += low_z * (1.0 / LO_SCALE)
        in_o += low_o * (1.0 / LO_SCALE)
    if SPLIT_STATE:
        st_i += low_si * (1.0 / LO_SCALE)
        st_f += low_sf * (1.0 / LO_SCALE)
        st_z += low_sz * (1.0 / LO_SCALE)
        st_o += low_so * (1.0 / LO_SCALE)
    return in_i, in_f, in_z, in_o, st_i, st_f, st_z, st_o


@triton.jit
def _bias(bias_ptr, col, j_mask, width, g: tl.constexpr):
    return tl.load(bias_ptr + g * width + col, mask=j_mask, other=0.0)[None, :]


@triton.jit(do_not_specialize=["position"])
def _slstm_step_kernel(
    xc_ptr, xn_ptr, w_ptr, w_lo_ptr, bias_ptr, pre_ptr, c_ptr, n_ptr, m_ptr, y_ptr, seq_slot_ptr, seq_start_ptr,
    out_ptr, sequences, position, width, size, tiles_per_block, stride_xc, stride_xn, stride_pre, stride_c, stride_n,
    stride_m, stride_y, stride_out, y_eps,
    FIRST: tl.constexpr, PRE: tl.constexpr, SPLIT: tl.constexpr, SPLIT_STATE: tl.constexpr, LO_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Row `position` of a tile of sequences (those that long): its y_prev the state y (FIRST, position 0) or
    the previous row's output. PRE: the input maps' part of the gates (with the bias) is read from pre_ptr
    ([B, 4, H], _slstm_input_gates_kernel), else computed here. SPLIT: the input maps' low halves at w_lo_ptr
    (laid out as w_ptr's first four maps); SPLIT_STATE: the state maps' too, as w_ptr's last four."""
    block = tl.program_id(0) // tiles_per_block
    j = (tl.program_id(0) % tiles_per_block) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns in the block
    s = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    s_mask, j_mask = s < sequences, j < size
    r = tl.load(seq_start_ptr + s, mask=s_mask, other=0) + position
    r_mask = s_mask & (r < tl.load(seq_start_ptr + s + 1, mask=s_mask, other=0))
    if tl.max(r_mask.to(tl.int32), axis=0) == 0:
        return  # no sequence of this tile has a row here: a step's shorter than its shape's max_rows read nothing
    slot = tl.load(seq_slot_ptr + s, mask=s_mask, other=0).to(tl.int64)
    if FIRST:
        y_rows = y_ptr + slot * stride_y
    else:
        y_rows = out_ptr + (r - 1).to(tl.int64) * stride_out
    in_i, in_f, in_z, in_o, st_i, st_f, st_z, st_o = _gate_products(
        xc_ptr, xn_ptr, y_rows, r, r_mask, stride_xc, stride_xn, w_ptr, w_lo_ptr, block, j, j_mask, size,
        width * size, not PRE, True, SPLIT, SPLIT_STATE, LO_SCALE, BLOCK_M, BLOCK_N, BLOCK_K)
    col = block * size + j
    mask = r_mask[:, None] & j_mask[None, :]
    if PRE:
        pre = pre_ptr + r[:, None] * stride_pre + col[None, :]
        i = st_i + tl.load(pre, mask=mask, other=0.0)
        f = st_f + tl.load(pre + width, mask=mask, other=0.0)
        z = st_z + tl.load(pre + 2 * width, mask=mask, other=0.0)
        o = st_o + tl.load(pre + 3 * width, mask=mask, other=0.0)
    else:  # the same sums as the input gates' kernel and PRE's: (x W_in + b) + y_prev W_state
        i = st_i + (in_i + _bias(bias_ptr, col, j_mask, width, 0))
        f = st_f + (in_f + _bias(bias_ptr, col, j_mask, width, 1))
        z = st_z + (in_z + _bias(bias_ptr, col, j_mask, width, 2))
        o = st_o + (in_o + _bias(bias_ptr, col, j_mask, width, 3))
    c_ptrs = c_ptr + slot[:, None] * stride_c + col[None, :]
    n_ptrs = n_ptr + slot[:, None] * stride_n + col[None, :]
    m_ptrs = m_ptr + slot[:, None] * stride_m + col[None, :]
    c = tl.load(c_ptrs, mask=mask, other=0.0)
    n = tl.load(n_ptrs, mask=mask, other=0.0)
    m = tl.load(m_ptrs, mask=mask, other=0.0)
    lf = m + logsigmoid(f)
    m_new = tl.maximum(i, lf)
    i_gate = tl.exp(i - m_new)
    f_gate = tl.where(lf == float("-inf"), 0.0, tl.exp(lf - m_new))
    c = f_gate * c + i_gate * tanh(z)
    n = f_gate * n + i_gate
    tl.store(c_ptrs, c, mask=mask)
    tl.store(n_ptrs, n, mask=mask)
    tl.store(m_ptrs, m_new, mask=mask)
    tl.store(out_ptr + r[:, None] * stride_out + col[None, :], sigmoid(o) * c / (n + y_eps), mask=mask)


@triton.jit
def _slstm_input_gates_kernel(
    xc_ptr, xn_ptr, w_ptr, w_lo_ptr, bias_ptr, seq_start_ptr, pre_ptr, sequences, width, size, tiles_per_map,
    stride_xc, stride_xn, stride_pre,
    SPLIT: tl.constexpr, LO_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One gate's input map with its bias, x W_in + b, for a tile of BLOCK_M of a step's rows (padding rows, from
    seq_starts[G] on, skipped) over BLOCK_N columns of one head block: pre [B, 4, H]. The products are the skinny
    kernel's (kernels/skinny_matmul.py), in the order _gate_products sums them. The row tiles of a column tile are
    consecutive programs (axis 0), so they read its weights from memory once."""
    live = tl.load(seq_start_ptr + sequences)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= live:
        return
    gate = tl.program_id(1) // tiles_per_map
    block = (tl.program_id(1) % tiles_per_map) // tl.cdiv(size, BLOCK_N)
    j = (tl.program_id(1) % tl.cdiv(size, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if gate < 2:  # i and f read xc, z and o xn
        x_ptrs = xc_ptr + r[:, None] * stride_xc + (block * size + k)[None, :]
    else:
        x_ptrs = xn_ptr + r[:, None] * stride_xn + (block * size + k)[None, :]
    map_offset = gate * width * size + block * size * size  # map `gate`, block `block`: [s, s] (out, in)
    acc = tile_products(x_ptrs, w_ptr + map_offset, w_lo_ptr + map_offset, j[:, None] * size + k[None, :], r, j,
                        live, size, size, size, SPLIT, LO_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, True, False)
    col = block * size + j
    j_mask = j < size
    pre = acc + tl.load(bias_ptr + gate * width + col, mask=j_mask, other=0.0)[None, :]
    tl.store(pre_ptr + r[:, None] * stride_pre + gate * width + col[None, :], pre,
             mask=(r < live)[:, None] & j_mask[None, :])


def supports(weight) -> bool:
    """The Triton kernel multiplies on 16-bit tensor cores (split fp32 maps too); unsplit fp32 weights take the
    reference."""
    return weight.dtype in WEIGHT_DTYPES


def slstm_step(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows=1, weight_lo=None, *,
               block_m=None, hoist_inputs=None):
    """Advance each sequence's sLSTM cell through its rows.

    xc, xn [B, H] (the convolved and the normalised input), weight [2, 4, NB, s, s] (pack_weights: input and
    state maps, gates i, f, z, o, each block as (out, in)), bias [4, H] (the state maps' biases); c, n, m, y
    [S, H] fp32 states (c = n = y = 0, m = -inf at start; each may be a slot-major view, kernels/_common.py);
    seq_slots [G] and seq_starts [G + 1] int32 (kernels/_common.py); max_rows (int) at least the longest
    sequence's row count, known when the step is built: one launch per row position. weight_lo [4, NB, s, s]
    fp16, with an fp16 weight: the input maps are split, weight[0] their high halves (pack_weights), and x is
    split likewise; weight_lo [2, 4, NB, s, s]: the state maps too, and y_prev with them. Updates c, n, m in
    place at seq_slots and returns y [B, H] float32, each row's new y (padding rows' unwritten), which the caller
    stores (y[seq_slots] is read, not written: slstm_output stores each sequence's last row). block_m: sequences
    a program, chosen here unless given (scripts/tile_sweep.py). hoist_inputs: the input maps' part of every row's
    gates in one launch before the row positions' launches (default: where max_rows > 1), which then read only the
    state maps; the same bits either way.
    """
    if not (use_triton(c) and supports(weight)):
        return slstm_step_ref(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows, weight_lo)
    xc, xn, weight, bias, weight_lo = _check(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows,
                                             weight_lo)
    rows, width = xc.shape
    sequences = seq_slots.shape[0]
    out = torch.empty(rows, width, device=c.device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return out
    blocks, size = weight.shape[2], weight.shape[3]
    block_m = block_m or max(16, min(MAX_BLOCK_M, next_pow2(sequences)))
    # pipeline stages of x tiles (3 x BLOCK_M x BLOCK_K fp32) and weight tiles (8 x BLOCK_N x BLOCK_K 16-bit, 12
    # split, 16 all split) that fit in shared memory; up to 32 rows two warps and four stages measured fastest at full
    # size (H100: 10.6 against 12.8 us at one row). Triton buffers stages - 1 of them: at 32 rows 3 x 40 KB, split
    # 3 x 48 KB, all split 3 x 56 KB, inside the 227 KB of an H100's SM
    block_k = max(16, min(BLOCK_K if block_m <= 32 else BLOCK_K // 2, next_pow2(size)))
    warps, stages = (2, 4) if block_m <= 32 else (4, 3)
    tiles = triton.cdiv(size, BLOCK_N)
    w_lo = weight if weight_lo is None else weight_lo  # unread unless split
    split, split_state = weight_lo is not None, weight_lo is not None and weight_lo.dim() == 5
    hoist = max_rows > 1 if hoist_inputs is None else hoist_inputs
    pre = out  # unread unless hoisted
    if hoist:
        pre = torch.empty(rows, GATES, width, device=c.device, dtype=torch.float32)
        # tiles of block_m rows: the row-at-a-time step of the same sequences tiles them alike (the same products'
        # instructions, so the same bits)
        input_n = min(INPUT_BLOCK_N, next_pow2(size))
        tiles_per_map = blocks * triton.cdiv(size, input_n)
        _slstm_input_gates_kernel[(triton.cdiv(rows, block_m), GATES * tiles_per_map)](
            xc, xn, weight, w_lo, bias, seq_starts, pre, sequences, width, size, tiles_per_map, xc.stride(0),
            xn.stride(0), pre.stride(0), SPLIT=split, LO_SCALE=LO_SCALE, BLOCK_M=block_m, BLOCK_N=input_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    for position in range(max_rows):
        _slstm_step_kernel[(blocks * tiles, triton.cdiv(sequences, block_m))](
            xc, xn, weight, w_lo, bias, pre, c, n, m, y, seq_slots, seq_starts, out,
            sequences, position, width, size, tiles, xc.stride(0), xn.stride(0), pre.stride(0), c.stride(0),
            n.stride(0), m.stride(0), y.stride(0), out.stride(0), Y_EPS,
            FIRST=position == 0, PRE=hoist, SPLIT=split, SPLIT_STATE=split_state, LO_SCALE=LO_SCALE,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return out
