"""Facts every layer shares, each stated once: the request's shape, the towers, the scoring tolerance and the server's
answer timeout, and how many queued requests of one symbol a step carries by default.

Imports nothing, so the protocol and the server can use it without loading torch.
"""
NUM_FEATURES = 79                                  # features per request
TOWER_NAMES = ("xlstm", "mamba2", "retnet", "hawk")  # the ensemble's towers, in prediction order
NUM_TOWERS = len(TOWER_NAMES)                      # predictions per request
ATOL = 1e-3                                        # a tower's prediction is correct within this of the target
# The project's server's answer timeout (s) by default: a later answer scores nothing. The original event's was never
# public (docs/facts.md), and its protocol has no welcome to say it, so a client of it assumes this one.
DEFAULT_TIMEOUT_S = 2.0
TARGET_SOURCES = ("model", "file")                 # --targets: the chosen weights' fp32 model, or a stream file's own
# Queued requests of one symbol a step may carry by default (the scheduler's cap, the fast engine's captured bound).
# Measured over 64 symbols on H100s, the highest rate with p99 under 50 ms: 11,000 requests/s at 4 (its 64x4 shape
# itself serves 15,700/s), 13,000-14,000 at 8, 5,000 at 1 (bench/LOG.md sections 45-47). At 8 the accuracy suite with
# a backlog of 8 requests of every symbol in every step failed once on RetNet's feed_mix (99.78%), which RetNet's
# input path in fp64 and the bias joining its product before the residual fixed (section 47).
DEFAULT_REQUESTS_PER_SYMBOL = 8
