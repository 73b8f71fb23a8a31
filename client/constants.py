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
# Measured over 64 symbols on an H100, the highest rate with p99 under 50 ms: 5,000 requests/s at 1, 8,000 at 4 and
# at 8 (a step's extra rows cost ~35 us each in compute, so 8 adds no rate; and its smallest several-rows shape
# made one symbol's two requests a 3.44 ms step against 2.86 at 4): bench/LOG.md section 36.
DEFAULT_REQUESTS_PER_SYMBOL = 4
