"""How one step of each tower runs on the state table: fused projections, Triton state kernels, 16-bit
weights with fp32 accumulation and fp32 state. Each block advances the table in place as a step's plan says
(StepPlan: the rows grouped in sequences, one per symbol; each recurrent kernel loads a symbol's state once and
advances it through the symbol's rows in order: kernels/_common.py).

Fusions (horizontal, where shapes allow): the four towers' input_up as one matrix; Mamba2's x/b/c/z
projections as one matrix, its three convolutions as one and its dt projection inside the state update;
RetNet's q/k/v/g as one matrix; Hawk's gate and recurrent projections as one; mLSTM's x/gate projections as
one. Vertically: every residual add with the RMSNorm after it (add_rms_norm; in xLSTM blocks also with the
sLSTM's LayerNorm and convolution, slstm_input), fc1's bias and ReLU in the GEMM epilogue, fc2's bias in the
next add; the sLSTM's eight block-diagonal gate maps with its cell (slstm_step); the mLSTM's convolution, its
1,024 4x4 q/k/v blocks and its gate projection (mlstm_input, finished inside mlstm_step); Mamba2's gate, norm
and cast.
"""
import contextlib
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from client.model.mamba2 import HEAD_SIZE, STATE_SIZE
from client.model.modules import FP32_EPS
from client.model.xlstm import SLSTM_HEADS
from kernels import (add_rms_norm, causal_conv_update, gated_rms_norm, gemv, mamba2_state_update, mlstm_input,
                     mlstm_output, mlstm_step, retention_step, retnet_output, rglru_step, skinny_matmul, slstm_input,
                     slstm_output, slstm_step, xlstm_residual)
from kernels._common import use_triton
from kernels.gemv import supports as gemv_supports
from kernels.mlstm_input import pack_qkv_weight
from kernels.skinny_matmul import LO_SCALE, split_fp16, split_rows
from kernels.skinny_matmul import supports as skinny_supports
from kernels.slstm_step import pack_weights as pack_slstm_weights

_OUT_DTYPE = {}


class StepPlan(NamedTuple):
    """Which state each row of a step advances (kernels/_common.py): sequence s owns rows seq_starts[s] ..
    seq_starts[s+1]-1 of the step and advances slot seq_slots[s]; max_rows bounds any sequence's length (the
    sLSTM's recurrent gate maps take one launch per row position)."""
    seq_slots: torch.Tensor   # int32 [G]
    seq_starts: torch.Tensor  # int32 [G + 1]
    max_rows: int = 1

    @property
    def sequences(self):
        return self.seq_slots, self.seq_starts

    @classmethod
    def one_row_each(cls, slot_ids):
        """Row b advances slot slot_ids[b] (distinct slots): the plan of a step of one request per symbol."""
        rows = slot_ids.shape[0]
        return cls(slot_ids, torch.arange(rows + 1, dtype=torch.int32, device=slot_ids.device), 1)


# while a step runs (live_rows()): its count of rows that requests took, int32 [1] on the device. A thread's own:
# steps may run side by side in threads (runner.precompile, shards stepping eagerly)
_LIVE = threading.local()


def _live_rows():
    return getattr(_LIVE, "rows", None)


@contextlib.contextmanager
def live_rows(count):
    """Inside the block (in this thread) a step's two-row products read, when they run, how many of its rows are
    live (count, int32 [1] on the device: its plan's last sequence start): a step of one symbol launched with a row
    of room for a join (engine.JOIN_ROOM) that no request took multiplies one row (kernels/gemv.py)."""
    before, _LIVE.rows = _live_rows(), count
    try:
        yield
    finally:
        _LIVE.rows = before


def _fp32_out_supported(device, dtype):
    """Whether mm/bmm(..., out_dtype=float32) run for `dtype` (fp16, bf16) inputs on this build and device: cuBLAS
    then writes its fp32 accumulator directly, with no rounding of the product to 16 bits."""
    key = (str(device), dtype)
    if key not in _OUT_DTYPE:
        a = torch.ones(2, 2, 8, device=device, dtype=dtype)
        try:
            _OUT_DTYPE[key] = (torch.mm(a[0], a[0].t(), out_dtype=torch.float32).dtype == torch.float32
                               and torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def mm32(x, w_t):
    """x @ w_t accumulated and returned in fp32 (x and w_t in the weight's dtype)."""
    if w_t.dtype != torch.float32:
        if _fp32_out_supported(x.device, w_t.dtype):
            return torch.mm(x, w_t, out_dtype=torch.float32)
        if x.device.type == "cpu":  # the 16-bit values' products exactly, summed in fp32: what cuBLAS computes
            return torch.mm(x.float(), w_t.float())
    return torch.mm(x, w_t).float()


def bmm32(x, w):
    if w.dtype != torch.float32:
        if _fp32_out_supported(x.device, w.dtype):
            return torch.bmm(x, w, out_dtype=torch.float32)
        if x.device.type == "cpu":
            return torch.bmm(x.float(), w.float())
    return torch.bmm(x, w).float()


# Most rows of a product that go through the skinny kernel, per Linear.kind (the names scripts/bench_matmul.py's
# table uses; None: any). Past 64 rows a product is a GEMM and the kernel tiles the rows. Split fp32 weights (whole
# or mixed): cuBLAS's true fp32 runs on the FMA units (~60 TFLOP/s on an H100, ~4 ms a step at 256 rows), the
# kernel's three fp16 tensor-core products at up to ~990: expected to win at every M. 16-bit weights: past one row
# tile cuBLAS runs its own tensor-core GEMM, which this kernel is not expected to beat. Neither is measured yet past
# 64 rows: set these from `scripts/bench_matmul.py --batches 1,4,16,64,128,256,512` (a finite limit adds a guard on
# the batch to the compiled step's graphs, see compiled.py).
SKINNY_MAX_ROWS = {"float32": None, "fp32+fp16": None, "float16": 64, "bfloat16": 64}


def skinny_pays(M, N):
    """Where the skinny kernel beats cuBLAS (scripts/bench_matmul.py, bench/matmul_h200.json): not for narrow
    outputs (N < 1024: too few programs to stream W), nor for N <= 2048 at one or two rows, where cuBLAS's
    GEMV splits K over more SMs than this kernel's N / BLOCK_N programs reach."""
    return N >= 1024 and (M > 2 or N > 2048)


class Linear:
    """y = x @ W^T + b: W stored in `dtype` (16-bit or fp32), products accumulated in fp32. After
    use_skinny(True) (the runner's choice per weight dtype) a step's few rows go through
    kernels/skinny_matmul.py, which streams W once and casts or splits x inside the kernel; otherwise, and for
    shapes it does not take, cuBLAS.

    `weights` may be several matrices stacked as one product, and `dtype` one dtype per matrix: fp32 ones first,
    then fp16 ones make one product whose leading rows keep about fp32 accuracy (a split fp16 pair) and whose
    other rows read fp16 alone; x then comes in fp32.

    An fp64 W (a tower's input path, client/engine/precision.py) multiplies x in fp64 and returns fp64: exact
    products of the fp32 weights, summed with 29 more bits than fp32's."""

    def __init__(self, weights, bias, dtype, device, wide_input=False):
        weights = list(weights) if isinstance(weights, (list, tuple)) else [weights]
        dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(weights)
        if len(dtypes) != len(weights):
            raise ValueError(f"one dtype per stacked weight: {len(weights)} weights, {len(dtypes)} dtypes")
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # one weight already in place: no copy
        self.weight_lo = None  # the split rows' low halves (mixed fp32/fp16 rows only)
        if len(set(dtypes)) == 1:
            self.weight = weight.to(device=device, dtype=dtypes[0]).contiguous()  # [out, in]
        else:
            weight = weight.to(device=device, dtype=torch.float32)
            split = sum(w.shape[0] for w, d in zip(weights, dtypes) if d == torch.float32)
            if dtypes != sorted(dtypes, key=lambda d: d != torch.float32) or set(dtypes) != {torch.float32,
                                                                                          torch.float16}:
                names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise ValueError(f"weights stacked in one product take one dtype, or fp32 then fp16; got {names}")
            hi, self.weight_lo = split_fp16(weight[:split])
            self.weight = torch.cat([hi, weight[split:].to(torch.float16)]).contiguous()
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        # for relu()'s fused epilogue (a mixed product has its own path)
        self.bias_w = (None if bias is None or self.weight_lo is not None
                       else bias.to(device=device, dtype=self.weight.dtype))
        self.skinny = None  # kwargs of skinny_matmul for W, when this product uses it
        self.gemv = None  # kwargs of kernels/gemv.py for W, for a step's one row (or two, one maybe unused)
        # x is not normalised (input_down's carries the features' scale): fp32 weights take cuBLAS's fp32, whose
        # accumulation keeps more bits than the tensor cores' (kernels/skinny_matmul.py), 16-bit ones x row-scaled
        self.wide_input = wide_input
        if self.weight.dtype != torch.float64:
            _fp32_out_supported(device, self.weight.dtype)  # probed now rather than inside a torch.compile trace

    def use_skinny(self, on):
        """Route products through the skinny kernel (where Triton runs; up to SKINNY_MAX_ROWS rows); an fp32 W is
        then kept as a split fp16 pair too (about fp32 accuracy on fp16 tensor cores)."""
        if not (on and use_triton(self.weight)) or self.wide_input or self.weight.dtype == torch.float64:
            self.skinny = None
        elif self.weight_lo is not None:
            self.skinny = {"weight": self.weight, "weight_lo": self.weight_lo}
        elif self.dtype == torch.float32:
            hi, lo = split_fp16(self.weight)
            self.skinny = {"weight": hi, "weight_lo": lo}
        else:
            self.skinny = {"weight": self.weight}

    def use_gemv(self, on):
        """Route a step's one row (two inside live_rows()) through kernels/gemv.py (where Triton runs), W read by
        every SM at once; not an unnormalised input (wide_input: cuBLAS's fp32) nor an fp64 W."""
        takes = (on and use_triton(self.weight) and not self.wide_input and self.weight.dtype != torch.float64
                 and gemv_supports(*self.weight.shape))
        self.gemv = {"weight": self.weight, "weight_lo": self.weight_lo} if takes else None

    @property
    def dtype(self):
        """The dtype x should come in: fp32 when any rows are fp32."""
        return torch.float32 if self.weight_lo is not None else self.weight.dtype

    @property
    def kind(self):
        """How W is stored, as SKINNY_MAX_ROWS and scripts/bench_matmul.py name it."""
        return "fp32+fp16" if self.weight_lo is not None else str(self.weight.dtype).removeprefix("torch.")

    @property
    def nbytes(self):
        lo = 0 if self.weight_lo is None else self.weight_lo.numel() * 2
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return self.weight.numel() * self.weight.element_size() + lo + bias

    def _use_gemv(self, x):
        return self.gemv is not None and (x.shape[0] == 1 or (x.shape[0] == 2 and _live_rows() is not None))

    def _gemv(self, x, **kwargs):
        return gemv(x, **self.gemv, **kwargs, live_rows=_live_rows() if x.shape[0] == 2 else None)

    def _use_skinny(self, x):
        if self.skinny is None:
            return False
        M, (N, K), max_rows = x.shape[0], self.weight.shape, SKINNY_MAX_ROWS[self.kind]
        return (max_rows is None or M <= max_rows) and skinny_supports(M, N, K) and skinny_pays(M, N)

    def product(self, x):
        """x @ W^T in fp32, without the bias (the caller fuses it into a later kernel)."""
        if self._use_gemv(x):
            return self._gemv(x)
        if self._use_skinny(x):
            return skinny_matmul(x, **self.skinny)
        if self.weight_lo is not None:  # the skinny kernel's split, through cuBLAS
            x_hi, x_lo = split_fp16(x.float())
            # the split's terms must reach the sum unrounded: where cuBLAS cannot return fp16 products in fp32,
            # multiply their values in fp32 (exact: fp16 x fp16 fits fp32's mantissa)
            mm = mm32 if _fp32_out_supported(x.device, torch.float16) else lambda a, b: torch.mm(a.float(), b.float())
            y = mm(x_hi, self.weight.t())
            rows = self.weight_lo.shape[0]
            y[:, :rows] += (mm(x_hi, self.weight_lo.t()) + mm(x_lo, self.weight[:rows].t())) / LO_SCALE
            return y
        if self.wide_input and self.weight.dtype == torch.float16:  # x cast without overflow, rows scaled back
            x_hi, _, unscale = split_rows(x)
            return mm32(x_hi, self.weight.t()) * unscale
        return mm32(x.to(self.dtype), self.weight.t())

    def __call__(self, x):
        if self._use_gemv(x):
            return self._gemv(x, bias=self.bias)
        if self._use_skinny(x):
            return skinny_matmul(x, bias=self.bias, **self.skinny)
        if self.weight.dtype == torch.float64:
            return F.linear(x.double(), self.weight, self.bias_w)  # fp64 out, bias included
        if self.dtype == torch.float32 and self.weight_lo is None:
            return F.linear(x, self.weight, self.bias)  # bias in the GEMM epilogue
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def relu(self, x):
        """relu(x @ W^T + b) in self.dtype with bias and ReLU in the GEMM epilogue: it only feeds the next
        product, which reads it in this dtype anyway."""
        if self._use_gemv(x):
            return self._gemv(x, bias=self.bias, relu=True, out_dtype=self.dtype)
        if self._use_skinny(x):
            return skinny_matmul(x, bias=self.bias, relu=True, out_dtype=self.dtype, **self.skinny)
        if self.weight_lo is not None:
            return torch.relu(self(x))
        return torch._addmm_activation(self.bias_w, x.to(self.dtype), self.weight.t())


class BlockDiagonal:
    """Several block-diagonal maps of one input (nb blocks of s x s each, weights [nb, s, s] as (out, in)) as
    ONE batched product."""

    def __init__(self, weights, dtype, device):
        nb, s, _ = weights[0].shape
        w = torch.cat([weight.transpose(1, 2) for weight in weights], dim=2)
        self.weight = w.to(device=device, dtype=dtype).contiguous()  # [nb, s (in), outputs * s]
        _fp32_out_supported(device, dtype)
        self.blocks, self.size, self.outputs = nb, s, len(weights)

    @property
    def kind(self):
        """How W is stored, as SKINNY_MAX_ROWS and scripts/bench_matmul.py name it."""
        return "fp32+fp16" if self.weight_lo is not None else str(self.weight.dtype).removeprefix("torch.")

    @property
    def nbytes(self):
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x):
        """x [B, nb*s] -> fp32 [B, outputs, nb, s], a strided view (output g of row b at [b, g])."""
        B, nb, s = x.shape[0], self.blocks, self.size
        out = bmm32(x.view(B, nb, s).transpose(0, 1).to(self.weight.dtype), self.weight)  # [nb, B, outputs*s]
        return out.view(nb, B, self.outputs, s).permute(1, 2, 0, 3)


def _conv(sd, name, device):
    return sd[name + ".conv.weight"][:, 0, :].contiguous().to(device), sd[name + ".conv.bias"].to(device)


class Block:
    """norm1 -> layer -> residual; norm2 -> MLP -> residual. Each residual add is fused with the RMSNorm after
    it: a block takes the previous block's pending (delta, bias) and returns its own, so `x += fc2 output +
    fc2 bias` happens inside the next block's norm1 (or at the tower's end).

    `dtype_of(group)` gives each weight group's dtype (client.engine.precision.WEIGHT_GROUPS: the names a precision
    override may use, as "<tower>.<group>"); an activation that feeds only one group's product is rounded to that
    group's dtype."""

    norm1_dtype = torch.float32  # the layer's input stays fp32 where it also feeds an fp32 path or a skip

    def __init__(self, sd, prefix, dtype_of, device):
        self.mlp_dtype = dtype_of("mlp")
        self.norm1 = sd[prefix + "norm1.weight"].to(device)
        self.norm2 = sd[prefix + "norm2.weight"].to(device)
        self.fc1 = Linear(sd[prefix + "mlp.fc1.weight"], sd[prefix + "mlp.fc1.bias"], self.mlp_dtype, device)
        self.fc2 = Linear(sd[prefix + "mlp.fc2.weight"], sd[prefix + "mlp.fc2.bias"], self.mlp_dtype, device)

    def __call__(self, x, delta, bias, st, plan):
        t = add_rms_norm(x, delta, bias, self.norm1, FP32_EPS, self.norm1_dtype)
        t2 = add_rms_norm(x, self.layer(t, st, plan), None, self.norm2, FP32_EPS, self.mlp_dtype)
        return self.mlp(t2)

    def mlp(self, t2):
        """fc2(relu(fc1(t2))) without fc2's bias: (delta, bias) for the next add."""
        return self.fc2.product(self.fc1.relu(t2)), self.fc2.bias

    def parts(self):
        return [v for v in vars(self).values() if hasattr(v, "nbytes")]


class XLSTMBlock(Block):

    def __init__(self, sd, prefix, cfg, dtype_of, device):
        super().__init__(sd, prefix, dtype_of, device)
        s, m = prefix + "layer.slstm.", prefix + "layer.mlstm."
        self.inner, self.heads = 2 * cfg.hidden, cfg.heads
        self.s_norm = sd[s + "norm.weight"].to(device)
        self.s_conv = _conv(sd, s + "conv1d", device)
        # fp32 maps come split into fp16 halves (kernels/slstm_step.py): weight_lo their low halves
        weight, weight_lo = pack_slstm_weights([sd[s + f"{g}gate_input.weight"] for g in "ifzo"],
                                               [sd[s + f"{g}gate_state.weight"] for g in "ifzo"],
                                               dtype_of("slstm_in"), dtype_of("slstm"))
        self.s_weight = weight.to(device)
        self.s_weight_lo = None if weight_lo is None else weight_lo.to(device)
        self.s_bias = torch.stack([sd[s + f"{g}gate_state.bias"] for g in "ifzo"]).to(device)  # [4, H]
        self.s_gn = sd[s + "group_norm.weight"].to(device), sd[s + "group_norm.bias"].to(device)
        self.m_norm = sd[m + "norm.weight"].to(device)
        # x_proj feeds q, k, v and the near-degenerate heads' GroupNorm; gate_proj acts after it (LOG section 34)
        self.m_xg = Linear([sd[m + "x_proj.weight"], sd[m + "gate_proj.weight"]], None,
                           [dtype_of("mlstm_x"), dtype_of("mlstm_gate")], device)
        self.m_conv = _conv(sd, m + "conv1d", device)
        self.m_qkv = pack_qkv_weight(*(sd[m + f"{t}_proj.weight"] for t in "qkv")).to(device, dtype_of("mlstm_qkv"))
        cell = m + "mlstm_cell."
        # tiny, and they set the exponential gates: fp32
        self.m_gate_w = torch.cat([sd[cell + "igate_proj.weight"], sd[cell + "fgate_proj.weight"]]).to(device)
        self.m_gate_b = torch.cat([sd[cell + "igate_proj.bias"], sd[cell + "fgate_proj.bias"]]).to(device)
        self.m_outnorm = sd[cell + "outnorm.weight"].to(device), sd[cell + "outnorm.bias"].to(device)
        self.m_skip = sd[m + "learnable_skip"].to(device)
        self.m_down = Linear(sd[m + "proj_down.weight"], None, dtype_of("mlstm_down"), device)
        self.final_norm = sd[prefix + "layer.final_norm.weight"].to(device)

    @staticmethod
    def state_layout(cfg, matrix_dtype=torch.float32):
        """{component: (per-slot shape, dtype, initial value)}; the matrix memory C may be stored in 16 bits."""
        H, inner, NH = cfg.hidden, 2 * cfg.hidden, cfg.heads
        E, f32 = inner // NH, torch.float32
        return {"slstm.conv": ((H, 3), f32, 0.0), "slstm.y": ((H,), f32, 0.0), "slstm.c": ((H,), f32, 0.0),
                "slstm.n": ((H,), f32, 0.0), "slstm.m": ((H,), f32, float("-inf")),
                "mlstm.conv": ((inner, 3), f32, 0.0), "mlstm.C": ((NH, E, E), matrix_dtype, 0.0),
                "mlstm.n": ((NH, E), f32, 0.0), "mlstm.m": ((NH,), f32, 0.0)}

    def __call__(self, x, delta, bias, st, plan):
        # norm1, the sLSTM's LayerNorm and its convolution in one kernel
        xin, xn, xc = slstm_input(x, delta, bias, self.norm1, FP32_EPS, self.s_norm, st["slstm.conv"], *self.s_conv,
                                  *plan.sequences)
        m, s_out = self.layer(xin, xn, xc, st, plan)
        # x += final_norm(m + s_out), then norm2, in one kernel
        return self.mlp(xlstm_residual(x, m, s_out, self.final_norm, self.norm2, FP32_EPS, self.mlp_dtype))

    def layer(self, xin, xn, xc, st, plan):
        """The xLSTM layer after slstm_input, up to its final LayerNorm: (mLSTM out_proj product m, sLSTM block
        output s_out), with the layer's output final_norm(m + s_out)."""
        B, inner, NH = xin.shape[0], self.inner, self.heads
        # sLSTM: gate maps and cell in one kernel; slstm_output stores the new y
        y = slstm_step(xc, xn, self.s_weight, self.s_bias, st["slstm.c"], st["slstm.n"], st["slstm.m"],
                       st["slstm.y"], *plan.sequences, max_rows=plan.max_rows, weight_lo=self.s_weight_lo)
        s_out, xn = slstm_output(y, xin, *self.s_gn, self.m_norm, SLSTM_HEADS, self.m_xg.dtype, st["slstm.y"],
                                 *plan.sequences)
        # mLSTM
        xm_xg = self.m_xg.product(xn)
        xm, xg = xm_xg[:, :inner], xm_xg[:, inner:]
        xc, qkv, gate_parts = mlstm_input(xm, st["mlstm.conv"], *self.m_conv, self.m_qkv, self.m_gate_w,
                                          self.m_gate_b, *plan.sequences)
        q, k, v = (qkv[:, j].view(B, NH, -1) for j in range(3))
        h = mlstm_step(st["mlstm.C"], st["mlstm.n"], st["mlstm.m"], q, k, v, gate_parts[:, :, :NH],
                       gate_parts[:, :, NH:], *plan.sequences, rounding=st["rounding"])
        gated = mlstm_output(h.reshape(B, inner), xc, xg, self.m_skip, *self.m_outnorm, NH, self.m_down.dtype)
        return self.m_down.product(gated), s_out


class Mamba2Block(Block):

    def __init__(self, sd, prefix, cfg, dtype_of, device):
        super().__init__(sd, prefix, dtype_of, device)
        p = prefix + "layer."
        self.inner, self.heads = 2 * cfg.hidden, 2 * cfg.hidden // HEAD_SIZE
        # x, b, c first (they share one convolution), then z
        self.in_proj = Linear([sd[p + "input_proj.weight"], sd[p + "b_proj.weight"], sd[p + "c_proj.weight"],
                               sd[p + "z_proj.weight"]], None, dtype_of("in_proj"), device)
        # fp32, projected inside mamba2_state_update
        self.dt_weight, self.dt_bias = sd[p + "dt_proj.weight"].to(device), sd[p + "dt_proj.bias"].to(device)
        convs = ("input_conv", "b_conv", "c_conv")
        self.conv = (torch.cat([sd[p + f"{n}.conv.weight"][:, 0, :] for n in convs]).to(device),
                     torch.cat([sd[p + f"{n}.conv.bias"] for n in convs]).to(device))
        self.a, self.d = sd[p + "a"].to(device), sd[p + "d"].to(device)
        self.norm = sd[p + "norm.weight"].to(device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype_of("out_proj"), device)

    @staticmethod
    def state_layout(cfg, matrix_dtype=torch.float32):
        inner = 2 * cfg.hidden
        return {"conv": ((inner + 2 * STATE_SIZE, 3), torch.float32, 0.0),
                "h": ((inner // HEAD_SIZE, HEAD_SIZE, STATE_SIZE), matrix_dtype, 0.0)}

    def layer(self, t, st, plan):
        B, inner, N = t.shape[0], self.inner, STATE_SIZE
        xbcz = self.in_proj.product(t)
        xbc = causal_conv_update(xbcz[:, :inner + 2 * N], st["conv"], *self.conv, *plan.sequences, "silu")
        y = mamba2_state_update(st["h"], xbc[:, :inner].view(B, self.heads, HEAD_SIZE), t, self.dt_weight,
                                self.dt_bias, self.a, xbc[:, inner:inner + N], xbc[:, inner + N:], self.d,
                                *plan.sequences,
                                rounding=st["rounding"])
        gated = gated_rms_norm(y.reshape(B, inner), xbcz[:, inner + 2 * N:], self.norm, 1e-5, self.out_proj.dtype)
        return self.out_proj.product(gated)


class RetNetBlock(Block):

    def __init__(self, sd, prefix, cfg, dtype_of, device):
        super().__init__(sd, prefix, dtype_of, device)
        p = prefix + "layer."
        self.heads, self.hidden = cfg.heads, cfg.hidden
        self.qkvg = Linear([sd[p + f"{n}_proj.weight"] for n in "qkvg"], None, dtype_of("qkvg"), device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype_of("out_proj"), device)
        self.decay, self.angle = sd[p + "decay"].to(device), sd[p + "angle"].to(device)

    @staticmethod
    def state_layout(cfg, matrix_dtype=torch.float32):
        D = cfg.hidden // cfg.heads
        return {"offset": ((), torch.int32, 0), "scale": ((cfg.heads,), torch.float32, 0.0),
                "S": ((cfg.heads, D, D), matrix_dtype, 0.0)}

    def layer(self, t, st, plan):
        B, H = t.shape[0], self.hidden
        qkvg = self.qkvg(t)
        q, k, v = (qkvg[:, j * H:(j + 1) * H].view(B, self.heads, -1) for j in range(3))
        o = retention_step(st["S"], st["scale"], st["offset"], q, k, v, self.decay, self.angle, *plan.sequences,
                           rounding=st["rounding"])
        return self.out_proj(retnet_output(o, qkvg[:, 3 * H:]))


class HawkBlock(Block):

    def __init__(self, sd, prefix, cfg, dtype_of, device):
        super().__init__(sd, prefix, dtype_of, device)
        p = prefix + "layer."
        self.hidden = cfg.hidden
        self.gate_rec = Linear([sd[p + "gate_proj.weight"], sd[p + "recurrent_proj.weight"]], None,
                               dtype_of("gate_rec"), device)
        self.norm1_dtype = self.gate_rec.dtype  # the layer's input feeds only this product
        self.conv = _conv(sd, p + "conv", device)
        self.gates = BlockDiagonal([sd[p + "rglru.input_gate.weight"], sd[p + "rglru.recurrence_gate.weight"]],
                                   dtype_of("rglru_gates"), device)
        self.a = sd[p + "rglru.a"].to(device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype_of("out_proj"), device)

    @staticmethod
    def state_layout(cfg, matrix_dtype=torch.float32):
        return {"conv": ((cfg.hidden, 3), torch.float32, 0.0), "h": ((cfg.hidden,), torch.float32, 0.0)}

    def layer(self, t, st, plan):
        B, H = t.shape[0], self.hidden
        gate_rec = self.gate_rec.product(t)
        u = causal_conv_update(gate_rec[:, H:], st["conv"], *self.conv, *plan.sequences, None)
        gates = self.gates(u).reshape(B, 2, H)
        return self.out_proj.product(rglru_step(gate_rec[:, :H], u, gates[:, 0], gates[:, 1], self.a, st["h"],
                                                *plan.sequences))


BLOCKS = {"xlstm": XLSTMBlock, "mamba2": Mamba2Block, "retnet": RetNetBlock, "hawk": HawkBlock}
