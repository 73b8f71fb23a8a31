"""Model configurations. Presets change only hidden, proj, depth and heads (docs/model/ensemble.md)."""
from dataclasses import dataclass, asdict

from client.constants import NUM_FEATURES, TOWER_NAMES  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    proj: int
    depth: int
    heads: int
    features: int = NUM_FEATURES

    def __post_init__(self):
        # Mamba2 heads of 64 over inner = 2*hidden; sLSTM and RG-LRU split hidden in 4 blocks;
        # mLSTM q/k/v blocks of 4; RetNet rotary pairs need an even head size, and at least two pairs: the
        # rotary frequencies 10000^(-j/(D/2-1)) are 0/0 for D = 2.
        if (min(self.hidden, self.proj, self.depth, self.heads, self.features) < 1 or self.hidden % 32
                or (2 * self.hidden) % self.heads or self.hidden % (2 * self.heads) or self.hidden // self.heads < 4):
            raise ValueError(f"unsupported model shape: {self}")

    def as_dict(self):
        return asdict(self)


PRESETS = {
    "full": ModelConfig(hidden=2048, proj=4096, depth=12, heads=8),
    "medium": ModelConfig(hidden=512, proj=1024, depth=4, heads=8),
    "small": ModelConfig(hidden=128, proj=256, depth=3, heads=4),
    "tiny": ModelConfig(hidden=64, proj=128, depth=2, heads=2),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
