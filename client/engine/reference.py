"""The fp32 reference engine: per-symbol batch-1 states, stacked into one batched forward per step."""
import numpy as np
import torch

from client.engine.base import NUM_TOWERS, Engine, check_step_inputs
from client.model.state import split_state, stack_states


class ReferenceEngine(Engine):
    name = "reference"

    def __init__(self, model, device=None):
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def symbols(self) -> list[str]:
        return list(self._states)

    def release(self, symbols) -> None:
        for symbol in symbols:
            self._states.pop(symbol, None)

    def describe(self) -> dict:
        return {"engine": self.name, "device": str(self.device), "symbols": len(self._states)}

    def step(self, symbols, features):
        symbols = list(symbols)
        features = check_step_inputs(symbols, features)
        if not symbols:
            return np.zeros((0, NUM_TOWERS), dtype=np.float32)
        states = [self._states[s] if s in self._states else self.model.init_state(1, device=self.device)
                  for s in symbols]
        with torch.no_grad():
            predictions, new_state = self.model(torch.from_numpy(features).to(self.device), stack_states(states))
        # Store only after the forward succeeded, so a failing step leaves every state as it was.
        for symbol, state in zip(symbols, split_state(new_state)):
            self._states[symbol] = state
        return predictions.detach().to("cpu", torch.float32).numpy()
