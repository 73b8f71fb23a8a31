"""The fp32 reference ensemble (docs/model/): the "theoretical prediction" everything is checked against."""
import torch

from .config import NUM_FEATURES, PRESETS, TOWER_NAMES, ModelConfig, get_preset
from .ensemble import Ensemble
from .state import select_rows, split_state, stack_states

__all__ = ["Ensemble", "ModelConfig", "PRESETS", "TOWER_NAMES", "NUM_FEATURES", "get_preset", "manifest",
           "manifest_for", "load_model", "ModelLoader", "stack_states", "split_state", "select_rows"]


def manifest_for(cfg: ModelConfig):
    """[{name, shape, dtype}] of the state dict, built on the meta device (no weights allocated)."""
    with torch.device("meta"):
        model = Ensemble(cfg)
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in model.state_dict().items()]


def manifest(preset: str):
    return manifest_for(get_preset(preset))


def load_model(preset: str, weights=None, seed: int = 0, device="cpu"):
    """(model in eval mode on `device`, weights fingerprint): a checkpoint when `weights` is a path, else the
    deterministic synthetic weights for `seed`. Loading is strict: a mismatch lists the offending names."""
    from client.weights import check_state_dict, fingerprint, make_weights, read_checkpoint

    cfg = get_preset(preset)
    state = read_checkpoint(weights) if weights is not None else make_weights(cfg, seed)
    check_state_dict(state, manifest_for(cfg), source=f"checkpoint {weights}", preset=preset)
    fp = fingerprint(state)
    with torch.device("meta"):
        model = Ensemble(cfg)
    # assign keeps a tensor's layout: a checkpoint's transposed (non-contiguous) tensor, equal values and fingerprint,
    # would take other matmul kernels and change the reference's last bits
    model.load_state_dict({k: v.contiguous().to(device) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False), fp


class ModelLoader:
    """load_model's arguments, loaded when called: what make_engine and FastEngine take instead of the model, so
    that an engine holds the fp32 model only while it needs it. After the call, `fingerprint` is the weights'
    (None until then: an engine that loads its own, a sharded one, never calls it). `say`: a line written to stderr
    as it loads."""

    def __init__(self, preset: str, weights=None, seed: int = 0, device="cpu", say: str | None = None):
        self.preset, self.weights, self.seed, self.device, self.say = preset, weights, seed, device, say
        self.fingerprint = None

    def __call__(self):
        if self.say:
            import sys

            print(self.say, file=sys.stderr)
        model, self.fingerprint = load_model(self.preset, weights=self.weights, seed=self.seed, device=self.device)
        return model
