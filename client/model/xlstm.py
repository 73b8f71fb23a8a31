"""xLSTM layer = sLSTM block, then mLSTM block, then a final LayerNorm (docs/model/xlstm.md)."""
import torch
from torch import nn
import torch.nn.functional as F

from .modules import BlockLinear, CausalConv, GroupNorm, LayerNorm

SLSTM_HEADS = 4
QKV_BLOCK = 4  # mLSTM q/k/v are block-diagonal with blocks of 4


class SLSTMBlock(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = LayerNorm(hidden)
        self.conv1d = CausalConv(hidden)
        for gate in "ifzo":
            setattr(self, f"{gate}gate_input", BlockLinear(SLSTM_HEADS, hidden))
        for gate in "ifzo":
            setattr(self, f"{gate}gate_state", BlockLinear(SLSTM_HEADS, hidden, bias=True))
        self.group_norm = GroupNorm(SLSTM_HEADS, hidden)

    def init_state(self, batch, device=None):
        hidden = self.norm.weight.shape[0]
        zeros = lambda: torch.zeros(batch, hidden, device=device)  # noqa: E731
        return {"conv": self.conv1d.init_state(batch, device), "y": zeros(), "c": zeros(), "n": zeros(),
                "m": torch.full((batch, hidden), float("-inf"), device=device)}

    def forward(self, x, state):
        xn = self.norm(x)
        xc, conv = self.conv1d(xn, state["conv"])
        xc = F.silu(xc)
        y = state["y"]
        i = self.igate_input(xc) + self.igate_state(y)
        f = self.fgate_input(xc) + self.fgate_state(y)
        z = self.zgate_input(xn) + self.zgate_state(y)
        o = self.ogate_input(xn) + self.ogate_state(y)
        lf = state["m"] + F.logsigmoid(f)
        m = torch.maximum(i, lf)
        i_act, f_act = torch.exp(i - m), torch.exp(lf - m)
        c = f_act * state["c"] + i_act * torch.tanh(z)
        n = f_act * state["n"] + i_act
        y = torch.sigmoid(o) * c / (n + 1e-6)
        return self.group_norm(y) + x, {"conv": conv, "y": y, "c": c, "n": n, "m": m}


class MLSTMCell(nn.Module):
    def __init__(self, inner, heads):
        super().__init__()
        self.num_heads = heads
        self.igate_proj = nn.Linear(3 * inner, heads)
        self.fgate_proj = nn.Linear(3 * inner, heads)
        self.outnorm = GroupNorm(heads, inner)


class MLSTMBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        inner = 2 * hidden
        self.num_heads, self.head_size = heads, inner // heads
        self.learnable_skip = nn.Parameter(torch.ones(inner))
        self.norm = LayerNorm(hidden)
        self.x_proj = nn.Linear(hidden, inner, bias=False)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.q_proj = BlockLinear(inner // QKV_BLOCK, inner)
        self.k_proj = BlockLinear(inner // QKV_BLOCK, inner)
        self.v_proj = BlockLinear(inner // QKV_BLOCK, inner)
        self.conv1d = CausalConv(inner)
        self.mlstm_cell = MLSTMCell(inner, heads)
        self.proj_down = nn.Linear(inner, hidden, bias=False)

    def init_state(self, batch, device=None):
        NH, E = self.num_heads, self.head_size
        return {"conv": self.conv1d.init_state(batch, device),
                "C": torch.zeros(batch, NH, E, E, device=device),
                "n": torch.zeros(batch, NH, E, device=device),
                "m": torch.zeros(batch, NH, device=device)}

    def forward(self, x, state):
        B, NH, E = x.shape[0], self.num_heads, self.head_size
        xn = self.norm(x)
        xm, xg = self.x_proj(xn), self.gate_proj(xn)
        xc, conv = self.conv1d(xm, state["conv"])
        xc = F.silu(xc)
        q, k, v = self.q_proj(xc), self.k_proj(xc), self.v_proj(xm)  # v from the unconvolved xm
        qkv = torch.cat([q, k, v], dim=-1)
        ip, fp = self.mlstm_cell.igate_proj(qkv), self.mlstm_cell.fgate_proj(qkv)  # [B, NH]
        q, k, v = (t.view(B, NH, E) for t in (q, k, v))
        lf = F.logsigmoid(fp)
        m_old = state["m"]
        m = torch.maximum(ip, m_old + lf)
        i_act, f_act = torch.exp(ip - m)[..., None], torch.exp(lf + m_old - m)[..., None]
        k = k / E**0.5
        C = f_act[..., None] * state["C"] + i_act[..., None] * k[..., :, None] * v[..., None, :]
        n = f_act * state["n"] + i_act * k
        num = torch.einsum("bhd,bhde->bhe", q, C)
        den = torch.maximum((q * n).sum(-1).abs(), torch.exp(-m)) + 1e-6
        h = self.mlstm_cell.outnorm((num / den[..., None]).flatten(1))
        out = self.proj_down((h + self.learnable_skip * xc) * F.silu(xg)) + x
        return out, {"conv": conv, "C": C, "n": n, "m": m}


class XLSTM(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.slstm = SLSTMBlock(hidden)
        self.mlstm = MLSTMBlock(hidden, heads)
        self.final_norm = LayerNorm(hidden)

    def init_state(self, batch, device=None):
        return {**{f"slstm.{k}": v for k, v in self.slstm.init_state(batch, device).items()},
                **{f"mlstm.{k}": v for k, v in self.mlstm.init_state(batch, device).items()}}

    def forward(self, x, state):
        sub = lambda prefix: {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}  # noqa: E731
        x, s_state = self.slstm(x, sub("slstm."))
        x, m_state = self.mlstm(x, sub("mlstm."))
        new_state = {**{f"slstm.{k}": v for k, v in s_state.items()},
                     **{f"mlstm.{k}": v for k, v in m_state.items()}}
        return self.final_norm(x), new_state
