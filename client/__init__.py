"""Streaming inference client for the recurrent ensemble: protocol, runtime, engines.

The original event's team-client names are importable from here, for team code written for it
(client/original_team.py); importing the package loads no torch.
"""
import os

# CUDA gives a process 8 hardware queues by default and maps its streams onto them in turn, so that a step stream
# sharing one with a state copy's stream may wait behind that whole copy (~3 ms a state: the swap section's long
# steps, bench/LOG.md section 46). 32 is the most it allows; it is read when the CUDA context is created, so it is
# set before anything touches the GPU.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from client.original_team import BaseInferenceClient, InferenceResponse, PendingRequest  # noqa: E402

__all__ = ["BaseInferenceClient", "InferenceResponse", "PendingRequest"]
