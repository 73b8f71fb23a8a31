"""Streaming inference client for the recurrent ensemble: protocol, runtime, engines.

The original event's team-client names are importable from here, for team code written for it
(client/original_team.py); importing the package loads no torch.
"""
from client.original_team import BaseInferenceClient, InferenceResponse, PendingRequest

__all__ = ["BaseInferenceClient", "InferenceResponse", "PendingRequest"]
