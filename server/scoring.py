"""How the server scores a response.

For each request the server records its send time (when it fell due and went out; a request that
fell due while its team was disconnected counts as sent then, and a resend keeps that time):

    latency_ms  = (server receive time of the response - server send time of the request) * 1000
    correct     = number of towers (0..4) with |prediction - target| <= atol      (atol = 1e-3)
    pnl         = (correct / 4) * 0.5 ** (latency_ms / half_life_ms)             (half_life_ms = 100)

A request not answered within timeout_s (2 s) of its send time is missed: pnl 0, and a later
answer still gets pnl 0. Targets are the fp32 reference model's predictions. Accuracy is the
fraction of tower predictions judged correct over answered requests. Defaults are below (the timeout's in
client/constants.py, which the client shares).
"""
import numpy as np

from client.constants import ATOL, DEFAULT_TIMEOUT_S  # noqa: F401  (DEFAULT_TIMEOUT_S: the server's default)


DEFAULT_HALF_LIFE_MS = 100.0


def score_responses(predictions: np.ndarray, targets: np.ndarray, latencies_ms: np.ndarray,
                    atol: float = ATOL, half_life_ms: float = DEFAULT_HALF_LIFE_MS):
    """Return (correct towers per request int [n], pnl per request float [n]) for answers in time."""
    # float64 so that the atol comparison is not blurred by float32 rounding of the difference
    error = np.abs(predictions.astype(np.float64) - targets.astype(np.float64))
    correct = (error <= atol).sum(axis=1)  # NaN compares False: counts as wrong
    pnl = (correct / 4.0) * np.power(0.5, np.asarray(latencies_ms, dtype=np.float64) / half_life_ms)
    return correct.astype(np.int64), pnl
