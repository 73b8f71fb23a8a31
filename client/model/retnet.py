"""RetNet (multi-scale retention) layer, one step (docs/model/retnet.md)."""
import torch
from torch import nn
import torch.nn.functional as F


def rotate_pairs(u):
    """(u[2j], u[2j+1]) -> (-u[2j+1], u[2j])."""
    even, odd = u[..., 0::2], u[..., 1::2]
    return torch.stack([-odd, even], dim=-1).flatten(-2)


class RetNet(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads, self.head_size = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.g_proj = nn.Linear(hidden, hidden, bias=False)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)
        self.register_buffer("decay", torch.empty(heads))
        self.register_buffer("angle", torch.empty(self.head_size))

    def init_state(self, batch, device=None):
        Hh, D = self.num_heads, self.head_size
        return {
            "offset": torch.zeros(batch, dtype=torch.int32, device=device),
            "scale": torch.zeros(batch, Hh, device=device),
            "S": torch.zeros(batch, Hh, D, D, device=device),
        }

    def forward(self, x, state):
        B, Hh, D = x.shape[0], self.num_heads, self.head_size
        q = self.q_proj(x).view(B, Hh, D)
        k = (self.k_proj(x) * D**-0.5).view(B, Hh, D)
        v = self.v_proj(x).view(B, Hh, D)
        g = self.g_proj(x)
        theta = state["offset"][:, None, None].float() * self.angle[None, None, :]
        cos, sin = torch.cos(theta), torch.sin(theta)
        q_rot = q * cos + rotate_pairs(q) * sin
        k_rot = k * cos + rotate_pairs(k) * sin
        S = state["S"] * self.decay[None, :, None, None] + k_rot[..., :, None] * v[..., None, :]
        scale = state["scale"] * self.decay + 1
        o = torch.einsum("bhd,bhde->bhe", q_rot, S) / torch.sqrt(scale)[..., None]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6)  # per-head RMSNorm, no weight
        out = self.out_proj(F.silu(g) * o.flatten(1))
        return out, {"offset": state["offset"] + 1, "scale": scale, "S": S}
