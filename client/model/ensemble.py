"""Towers and the ensemble (docs/model/ensemble.md)."""
import torch
from torch import nn
import torch.nn.functional as F

from .config import TOWER_NAMES, ModelConfig
from .hawk import Hawk
from .mamba2 import Mamba2
from .modules import MLP, RMSNorm
from .retnet import RetNet
from .xlstm import XLSTM

LAYERS = {
    "xlstm": lambda cfg: XLSTM(cfg.hidden, cfg.heads),
    "mamba2": lambda cfg: Mamba2(cfg.hidden),
    "retnet": lambda cfg: RetNet(cfg.hidden, cfg.heads),
    "hawk": lambda cfg: Hawk(cfg.hidden),
}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden)
        self.layer = LAYERS[kind](cfg)
        self.norm2 = RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.proj)

    def forward(self, x, state):
        out, state = self.layer(self.norm1(x), state)
        x = x + out
        return x + self.mlp(self.norm2(x)), state


class Tower(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.input_up = nn.Linear(cfg.features, cfg.proj)
        self.input_down = nn.Linear(cfg.proj, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, kind) for _ in range(cfg.depth))

    def init_state(self, batch, device=None):
        return {f"{i}.{k}": v for i, block in enumerate(self.blocks)
                for k, v in block.layer.init_state(batch, device).items()}

    def forward(self, features, state):
        x = self.input_down(F.relu(self.input_up(features)))
        new_state = {}
        for i, block in enumerate(self.blocks):
            prefix = f"{i}."
            x, block_state = block(x, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            new_state.update({prefix + k: v for k, v in block_state.items()})
        return x, new_state


class Ensemble(nn.Module):
    """Four towers on the same 79 features; one shared output projection gives one prediction per tower.

    The state is a flat dict "<tower>.<block>.<component>" -> tensor with the batch (symbol) dimension first.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.towers = nn.ModuleList(Tower(cfg, kind) for kind in TOWER_NAMES)
        self.output_proj = nn.Linear(cfg.hidden, 1)

    def init_state(self, batch, device=None):
        if device is None:
            device = self.output_proj.weight.device
        return {f"{name}.{k}": v for name, tower in zip(TOWER_NAMES, self.towers)
                for k, v in tower.init_state(batch, device).items()}

    def forward(self, features, state):
        if features.ndim != 2 or features.shape[1] != self.cfg.features:
            raise ValueError(f"features must be [B, {self.cfg.features}], got {list(features.shape)}")
        predictions, new_state = [], {}
        for name, tower in zip(TOWER_NAMES, self.towers):
            prefix = f"{name}."
            x, tower_state = tower(features, {k[len(prefix):]: v for k, v in state.items()
                                              if k.startswith(prefix)})
            predictions.append(self.output_proj(x))
            new_state.update({prefix + k: v for k, v in tower_state.items()})
        return torch.cat(predictions, dim=1), new_state
