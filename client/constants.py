"""Facts every layer shares, each stated once: the request's shape, the towers, the scoring tolerance and how many
queued requests of one symbol a step carries by default.

Imports nothing, so the protocol and the server can use it without loading torch.
"""
NUM_FEATURES = 79                                  # features per request
TOWER_NAMES = ("xlstm", "mamba2", "retnet", "hawk")  # the ensemble's towers, in prediction order
NUM_TOWERS = len(TOWER_NAMES)                      # predictions per request
ATOL = 1e-3                                        # a tower's prediction is correct within this of the target
TARGET_SOURCES = ("model", "file")                 # --targets: the chosen weights' fp32 model, or a stream file's own
# Queued requests of one symbol a step may carry by default (the scheduler's cap, the fast engine's captured bound).
# Measured over 64 symbols on an H100, the highest rate with p99 under 50 ms: 13,000 requests/s at 8 against 11,000
# at 4 and 5,000 at 1 (a near-full step of 64 symbols leaves room for the queue at 8, not at 4), and a backlog drains
# in fewer steps; since sLSTM launches past a step's longest sequence return at once, a step of a few requests costs
# the same at 8 as at 4 (bench/LOG.md sections 45, 46).
DEFAULT_REQUESTS_PER_SYMBOL = 8
