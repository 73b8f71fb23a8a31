"""Shared pieces of the reference ensemble (docs/model/ensemble.md, "Shared pieces"). Plain fp32 PyTorch."""
import torch
from torch import nn
import torch.nn.functional as F

FP32_EPS = torch.finfo(torch.float32).eps


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dimension."""

    def __init__(self, n, eps=FP32_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LayerNorm(nn.Module):
    """LayerNorm without bias, eps 1e-5."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


class GroupNorm(nn.Module):
    """Normalise each of `groups` equal channel groups of a [B, n] input; per-channel weight and bias."""

    def __init__(self, groups, n, eps=1e-5):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


class CausalConv(nn.Module):
    """Causal depthwise convolution of kernel 4, one step at a time; the state holds the last 3 inputs."""

    KERNEL = 4

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, self.KERNEL, groups=channels)

    def init_state(self, batch, device=None):
        return torch.zeros(batch, self.conv.in_channels, self.KERNEL - 1, device=device)

    def forward(self, x, state):
        window = torch.cat([state, x[..., None]], dim=-1)  # [B, C, 4], oldest first
        out = (window * self.conv.weight[:, 0, :]).sum(-1) + self.conv.bias
        return out, window[..., 1:]


class BlockLinear(nn.Module):
    """Block-diagonal linear map: out[blk, k] = sum_h x[blk, h] * weight[blk, k, h] (+ bias)."""

    def __init__(self, num_blocks, n, bias=False):
        super().__init__()
        size = n // num_blocks
        self.weight = nn.Parameter(torch.empty(num_blocks, size, size))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def forward(self, x):
        num_blocks, size, _ = self.weight.shape
        blocks = x.reshape(*x.shape[:-1], num_blocks, size)
        out = torch.einsum("...bh,bkh->...bk", blocks, self.weight).reshape(x.shape)
        return out if self.bias is None else out + self.bias


class MLP(nn.Module):
    def __init__(self, hidden, proj):
        super().__init__()
        self.fc1 = nn.Linear(hidden, proj)
        self.fc2 = nn.Linear(proj, hidden)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))
