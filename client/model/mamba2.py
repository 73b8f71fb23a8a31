"""Mamba2 layer, one step (docs/model/mamba2.md)."""
import torch
from torch import nn
import torch.nn.functional as F

from .modules import CausalConv, RMSNorm

HEAD_SIZE = 64  # P
STATE_SIZE = 128  # N, the size of b and c


class Mamba2(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        inner = 2 * hidden
        self.num_heads = inner // HEAD_SIZE
        self.input_proj = nn.Linear(hidden, inner, bias=False)
        self.z_proj = nn.Linear(hidden, inner, bias=False)
        self.b_proj = nn.Linear(hidden, STATE_SIZE, bias=False)
        self.c_proj = nn.Linear(hidden, STATE_SIZE, bias=False)
        self.dt_proj = nn.Linear(hidden, self.num_heads)
        self.input_conv = CausalConv(inner)
        self.b_conv = CausalConv(STATE_SIZE)
        self.c_conv = CausalConv(STATE_SIZE)
        self.a = nn.Parameter(torch.empty(self.num_heads))
        self.d = nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNorm(inner, eps=1e-5)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def init_state(self, batch, device=None):
        return {
            "conv_x": self.input_conv.init_state(batch, device),
            "conv_b": self.b_conv.init_state(batch, device),
            "conv_c": self.c_conv.init_state(batch, device),
            "h": torch.zeros(batch, self.num_heads, HEAD_SIZE, STATE_SIZE, device=device),
        }

    def forward(self, t, state):
        x, conv_x = self.input_conv(self.input_proj(t), state["conv_x"])
        b, conv_b = self.b_conv(self.b_proj(t), state["conv_b"])
        c, conv_c = self.c_conv(self.c_proj(t), state["conv_c"])
        x, b, c = F.silu(x), F.silu(b), F.silu(c)
        z = self.z_proj(t)
        dt = F.softplus(self.dt_proj(t))  # [B, H]
        x = x.view(x.shape[0], self.num_heads, HEAD_SIZE)
        decay = torch.exp(self.a * dt)[:, :, None, None]
        h = decay * state["h"] + dt[:, :, None, None] * x[:, :, :, None] * b[:, None, None, :]
        y = torch.einsum("bn,bhpn->bhp", c, h) + self.d[:, None] * x
        out = self.out_proj(self.norm(y.flatten(1) * F.silu(z)))
        return out, {"conv_x": conv_x, "conv_b": conv_b, "conv_c": conv_c, "h": h}
