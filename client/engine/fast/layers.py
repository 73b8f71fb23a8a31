"""How one step of each tower runs on the state table: fused projections, Triton state kernels, 16-bit
weights with fp32 accumulation and fp32 state. Each function advances the rows `slots` of the table in place.

Fusions (horizontal, where shapes allow): the four towers' input_up as one matrix; Mamba2's x/b/c/z
projections as one matrix and its three convolutions as one; RetNet's q/k/v/g as one matrix; Hawk's gate and
recurrent projections as one; mLSTM's x/gate projections as one and its 1,024 4x4 q/k blocks as one batched
product; the sLSTM's eight block-diagonal gate maps as three batched products.
"""
import torch
import torch.nn.functional as F

from client.model.mamba2 import HEAD_SIZE, STATE_SIZE
from client.model.modules import FP32_EPS
from client.model.xlstm import QKV_BLOCK, SLSTM_HEADS
from kernels import (causal_conv_update, mamba2_state_update, mlstm_step, retention_step, retnet_output,
                     rglru_step, slstm_cell)


class Linear:
    """y = x @ W^T + b: W stored in `dtype` (16-bit or fp32), products accumulated in fp32, y in fp32."""

    def __init__(self, weights, bias, dtype, device):
        weight = torch.cat(weights) if isinstance(weights, (list, tuple)) else weights
        self.weight_t = weight.to(device=device, dtype=dtype).contiguous()  # [out, in]
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        self.fp32_out = self.weight_t.is_cuda and dtype != torch.float32 and _has_mm_out_dtype(device)

    @property
    def nbytes(self):
        return self.weight_t.numel() * self.weight_t.element_size() + (
            0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x):
        w = self.weight_t
        if self.fp32_out:  # cuBLAS writes the fp32 accumulator directly: no rounding of y to 16 bits
            y = torch.mm(x.to(w.dtype), w.t(), out_dtype=torch.float32)
        else:
            y = F.linear(x.to(w.dtype), w).float()
        return y if self.bias is None else y + self.bias


_MM_OUT_DTYPE = {}


def _has_mm_out_dtype(device):
    """Whether torch.mm(..., out_dtype=float32) runs for 16-bit inputs on this build and device."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(2, 8, device=device, dtype=torch.float16)
            _MM_OUT_DTYPE[key] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


class BlockLinear:
    """G block-diagonal maps of `nb` blocks sharing one input, as one batched product:
    x [B, nb*s] -> [G, B, nb*s]."""

    def __init__(self, weights, dtype, device):
        # weights: G tensors [nb, s, s] (out, in) -> [nb, s_in, G*s_out]
        self.weight = torch.cat([w.transpose(1, 2) for w in weights], dim=2).to(device=device, dtype=dtype)
        self.groups = len(weights)

    @property
    def nbytes(self):
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x):
        nb, s, gs = self.weight.shape
        B = x.shape[0]
        out = torch.bmm(x.view(B, nb, s).transpose(0, 1).to(self.weight.dtype), self.weight)  # [nb, B, G*s]
        return out.float().view(nb, B, self.groups, s).permute(2, 1, 0, 3).reshape(self.groups, B, nb * s)


def rms_norm(x, weight, eps=FP32_EPS):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x, weight):
    return F.layer_norm(x, (x.shape[-1],), weight, None, 1e-5)


class MLP:
    def __init__(self, sd, prefix, dtype, device):
        self.norm2 = sd[prefix + "norm2.weight"].to(device)
        self.fc1 = Linear(sd[prefix + "mlp.fc1.weight"], sd[prefix + "mlp.fc1.bias"], dtype, device)
        self.fc2 = Linear(sd[prefix + "mlp.fc2.weight"], sd[prefix + "mlp.fc2.bias"], dtype, device)

    def __call__(self, x):
        return x + self.fc2(torch.relu(self.fc1(rms_norm(x, self.norm2))))


def _conv(sd, name, device):
    return sd[name + ".conv.weight"][:, 0, :].contiguous().to(device), sd[name + ".conv.bias"].to(device)


class XLSTMBlock:
    def __init__(self, sd, prefix, cfg, dtype, device):
        p, s, m = prefix, prefix + "layer.slstm.", prefix + "layer.mlstm."
        self.hidden, self.inner, self.heads = cfg.hidden, 2 * cfg.hidden, cfg.heads
        self.norm1 = sd[p + "norm1.weight"].to(device)
        self.s_norm = sd[s + "norm.weight"].to(device)
        self.s_conv = _conv(sd, s + "conv1d", device)
        self.s_if = BlockLinear([sd[s + "igate_input.weight"], sd[s + "fgate_input.weight"]], dtype, device)
        self.s_zo = BlockLinear([sd[s + "zgate_input.weight"], sd[s + "ogate_input.weight"]], dtype, device)
        self.s_state = BlockLinear([sd[s + f"{g}gate_state.weight"] for g in "ifzo"], dtype, device)
        self.s_state_bias = torch.stack([sd[s + f"{g}gate_state.bias"] for g in "ifzo"])[:, None, :].to(device)
        self.s_gn = sd[s + "group_norm.weight"].to(device), sd[s + "group_norm.bias"].to(device)
        self.m_norm = sd[m + "norm.weight"].to(device)
        self.m_xg = Linear([sd[m + "x_proj.weight"], sd[m + "gate_proj.weight"]], None, dtype, device)
        self.m_conv = _conv(sd, m + "conv1d", device)
        self.m_qk = BlockLinear([sd[m + "q_proj.weight"], sd[m + "k_proj.weight"]], torch.float32, device)
        self.m_v = BlockLinear([sd[m + "v_proj.weight"]], torch.float32, device)
        cell = m + "mlstm_cell."
        self.m_gates = Linear([sd[cell + "igate_proj.weight"], sd[cell + "fgate_proj.weight"]],
                              torch.cat([sd[cell + "igate_proj.bias"], sd[cell + "fgate_proj.bias"]]),
                              torch.float32, device)  # tiny and sets the exponential gates: fp32
        self.m_outnorm = sd[cell + "outnorm.weight"].to(device), sd[cell + "outnorm.bias"].to(device)
        self.m_skip = sd[m + "learnable_skip"].to(device)
        self.m_down = Linear(sd[m + "proj_down.weight"], None, dtype, device)
        self.final_norm = sd[prefix + "layer.final_norm.weight"].to(device)
        self.mlp = MLP(sd, prefix, dtype, device)

    @staticmethod
    def state_layout(cfg):
        H, inner, NH = cfg.hidden, 2 * cfg.hidden, cfg.heads
        E, f32 = inner // NH, torch.float32
        return {"slstm.conv": ((H, 3), f32, 0.0), "slstm.y": ((H,), f32, 0.0), "slstm.c": ((H,), f32, 0.0),
                "slstm.n": ((H,), f32, 0.0), "slstm.m": ((H,), f32, float("-inf")),
                "mlstm.conv": ((inner, 3), f32, 0.0), "mlstm.C": ((NH, E, E), f32, 0.0),
                "mlstm.n": ((NH, E), f32, 0.0), "mlstm.m": ((NH,), f32, 0.0)}

    def __call__(self, x, st, slots):
        B, inner, NH = x.shape[0], self.inner, self.heads
        xin = rms_norm(x, self.norm1)
        # sLSTM
        xn = layer_norm(xin, self.s_norm)
        xc = causal_conv_update(xn, st["slstm.conv"], *self.s_conv, slots, "silu")
        recurrent = self.s_state(st["slstm.y"][slots]) + self.s_state_bias  # [4, B, H]: i, f, z, o
        i_f, z_o = self.s_if(xc), self.s_zo(xn)
        y = slstm_cell(i_f[0] + recurrent[0], i_f[1] + recurrent[1], z_o[0] + recurrent[2], z_o[1] + recurrent[3],
                       st["slstm.c"], st["slstm.n"], st["slstm.m"], st["slstm.y"], slots)
        s_out = F.group_norm(y, SLSTM_HEADS, *self.s_gn, 1e-5) + xin
        # mLSTM
        xm_xg = self.m_xg(layer_norm(s_out, self.m_norm))
        xm, xg = xm_xg[:, :inner], xm_xg[:, inner:]
        xc = causal_conv_update(xm, st["mlstm.conv"], *self.m_conv, slots, "silu")
        q, k = self.m_qk(xc)
        v = self.m_v(xm)[0]
        gates = self.m_gates(torch.cat([q, k, v], dim=1))
        h = mlstm_step(st["mlstm.C"], st["mlstm.n"], st["mlstm.m"], q.view(B, NH, -1), k.view(B, NH, -1),
                       v.view(B, NH, -1), gates[:, :NH], gates[:, NH:], slots)
        h = F.group_norm(h.reshape(B, inner), NH, *self.m_outnorm, 1e-5)
        m_out = self.m_down((h + self.m_skip * xc) * F.silu(xg)) + s_out
        return self.mlp(x + layer_norm(m_out, self.final_norm))


class Mamba2Block:
    def __init__(self, sd, prefix, cfg, dtype, device):
        p = prefix + "layer."
        self.inner, self.heads = 2 * cfg.hidden, 2 * cfg.hidden // HEAD_SIZE
        self.norm1 = sd[prefix + "norm1.weight"].to(device)
        # x, b, c first (they share one convolution), then z
        self.in_proj = Linear([sd[p + "input_proj.weight"], sd[p + "b_proj.weight"], sd[p + "c_proj.weight"],
                               sd[p + "z_proj.weight"]], None, dtype, device)
        self.dt_proj = Linear(sd[p + "dt_proj.weight"], sd[p + "dt_proj.bias"], torch.float32, device)
        self.conv = (torch.cat([sd[p + f"{n}.conv.weight"][:, 0, :] for n in ("input_conv", "b_conv", "c_conv")]).to(device),
                     torch.cat([sd[p + f"{n}.conv.bias"] for n in ("input_conv", "b_conv", "c_conv")]).to(device))
        self.a, self.d = sd[p + "a"].to(device), sd[p + "d"].to(device)
        self.norm = sd[p + "norm.weight"].to(device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype, device)
        self.mlp = MLP(sd, prefix, dtype, device)

    @staticmethod
    def state_layout(cfg):
        inner = 2 * cfg.hidden
        return {"conv": ((inner + 2 * STATE_SIZE, 3), torch.float32, 0.0),
                "h": ((inner // HEAD_SIZE, HEAD_SIZE, STATE_SIZE), torch.float32, 0.0)}

    def __call__(self, x, st, slots):
        B, inner, N = x.shape[0], self.inner, STATE_SIZE
        t = rms_norm(x, self.norm1)
        xbcz = self.in_proj(t)
        xbc = causal_conv_update(xbcz[:, :inner + 2 * N], st["conv"], *self.conv, slots, "silu")
        y = mamba2_state_update(st["h"], xbc[:, :inner].view(B, self.heads, HEAD_SIZE), self.dt_proj(t), self.a,
                                xbc[:, inner:inner + N], xbc[:, inner + N:], self.d, slots)
        gated = y.reshape(B, inner) * F.silu(xbcz[:, inner + 2 * N:])
        return self.mlp(x + self.out_proj(rms_norm(gated, self.norm, 1e-5)))


class RetNetBlock:
    def __init__(self, sd, prefix, cfg, dtype, device):
        p = prefix + "layer."
        self.heads, self.hidden = cfg.heads, cfg.hidden
        self.norm1 = sd[prefix + "norm1.weight"].to(device)
        self.qkvg = Linear([sd[p + f"{n}_proj.weight"] for n in "qkvg"], None, dtype, device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype, device)
        self.decay, self.angle = sd[p + "decay"].to(device), sd[p + "angle"].to(device)
        self.mlp = MLP(sd, prefix, dtype, device)

    @staticmethod
    def state_layout(cfg):
        D = cfg.hidden // cfg.heads
        return {"offset": ((), torch.int32, 0), "scale": ((cfg.heads,), torch.float32, 0.0),
                "S": ((cfg.heads, D, D), torch.float32, 0.0)}

    def __call__(self, x, st, slots):
        B, H = x.shape[0], self.hidden
        qkvg = self.qkvg(rms_norm(x, self.norm1))
        q, k, v = (qkvg[:, j * H:(j + 1) * H].view(B, self.heads, -1) for j in range(3))
        o = retention_step(st["S"], st["scale"], st["offset"], q, k, v, self.decay, self.angle, slots)
        return self.mlp(x + self.out_proj(retnet_output(o, qkvg[:, 3 * H:])))


class HawkBlock:
    def __init__(self, sd, prefix, cfg, dtype, device):
        p = prefix + "layer."
        self.hidden = cfg.hidden
        self.norm1 = sd[prefix + "norm1.weight"].to(device)
        self.gate_rec = Linear([sd[p + "gate_proj.weight"], sd[p + "recurrent_proj.weight"]], None, dtype, device)
        self.conv = _conv(sd, p + "conv", device)
        self.gates = BlockLinear([sd[p + "rglru.input_gate.weight"], sd[p + "rglru.recurrence_gate.weight"]],
                                 dtype, device)
        self.a = sd[p + "rglru.a"].to(device)
        self.out_proj = Linear(sd[p + "out_proj.weight"], None, dtype, device)
        self.mlp = MLP(sd, prefix, dtype, device)

    @staticmethod
    def state_layout(cfg):
        return {"conv": ((cfg.hidden, 3), torch.float32, 0.0), "h": ((cfg.hidden,), torch.float32, 0.0)}

    def __call__(self, x, st, slots):
        H = self.hidden
        gate_rec = self.gate_rec(rms_norm(x, self.norm1))
        u = causal_conv_update(gate_rec[:, H:], st["conv"], *self.conv, slots, None)
        i_pre, r_pre = self.gates(u)
        return self.mlp(x + self.out_proj(rglru_step(gate_rec[:, :H], u, i_pre, r_pre, self.a, st["h"], slots)))


BLOCKS = {"xlstm": XLSTMBlock, "mamba2": Mamba2Block, "retnet": RetNetBlock, "hawk": HawkBlock}
