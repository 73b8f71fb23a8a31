"""The fp32 reference engine: per-symbol batch-1 states, stacked into one batched forward per round of a step
(round j: the j-th request of every symbol in the step, so a symbol's requests advance its state in order)."""
import numpy as np
import torch

from client.engine.base import NUM_TOWERS, Engine, Sequences, check_step_inputs
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
        states = {}  # the states as the step advances them, stored only after every round succeeded
        out = np.empty((len(symbols), NUM_TOWERS), dtype=np.float32)
        for rows in Sequences(symbols).rounds():
            batch = [symbols[i] for i in rows]
            before = [states.get(s) or self._states.get(s) or self.model.init_state(1, device=self.device)
                      for s in batch]
            with torch.no_grad():
                predictions, after = self.model(torch.from_numpy(features[rows]).to(self.device),
                                                stack_states(before))
            states.update(zip(batch, split_state(after)))
            out[rows] = predictions.detach().to("cpu", torch.float32).numpy()
        self._states.update(states)
        return out
