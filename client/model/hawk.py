"""Hawk layer: gated branch times an RG-LRU recurrence (docs/model/hawk.md)."""
import torch
from torch import nn
import torch.nn.functional as F

from .modules import BlockLinear, CausalConv

RGLRU_BLOCKS = 4
RGLRU_C = 8.0


class RGLRU(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.a = nn.Parameter(torch.empty(hidden))
        self.input_gate = BlockLinear(RGLRU_BLOCKS, hidden)
        self.recurrence_gate = BlockLinear(RGLRU_BLOCKS, hidden)

    def forward(self, u, h):
        i = torch.sigmoid(self.input_gate(u))
        r = torch.sigmoid(self.recurrence_gate(u))
        alpha = self.a ** (RGLRU_C * r)
        return alpha * h + torch.sqrt(1 - alpha**2) * (i * u)


class Hawk(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, hidden, bias=False)
        self.recurrent_proj = nn.Linear(hidden, hidden, bias=False)
        self.conv = CausalConv(hidden)
        self.rglru = RGLRU(hidden)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)

    def init_state(self, batch, device=None):
        return {"conv": self.conv.init_state(batch, device),
                "h": torch.zeros(batch, self.rglru.a.shape[0], device=device)}

    def forward(self, x, state):
        gate = F.gelu(self.gate_proj(x))
        u, conv = self.conv(self.recurrent_proj(x), state["conv"])  # no activation after the conv
        h = self.rglru(u, state["h"])
        return self.out_proj(gate * h), {"conv": conv, "h": h}
