"""Helpers for the reference model's flat state dicts (batch dimension first)."""
import torch


def stack_states(states):
    """Concatenate a list of state dicts along the batch dimension."""
    return {k: torch.cat([s[k] for s in states]) for k in states[0]}


def split_state(state):
    """Split a batched state dict into a list of batch-1 state dicts."""
    batch = next(iter(state.values())).shape[0]
    return [{k: v[i:i + 1] for k, v in state.items()} for i in range(batch)]


def select_rows(state, rows):
    """The rows `rows` (index tensor or list) of every component."""
    return {k: v[rows] for k, v in state.items()}
