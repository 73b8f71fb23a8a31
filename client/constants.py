"""Facts every layer shares, each stated once: the request's shape, the towers and the scoring tolerance.

Imports nothing, so the protocol and the server can use it without loading torch.
"""
NUM_FEATURES = 79                                  # features per request
TOWER_NAMES = ("xlstm", "mamba2", "retnet", "hawk")  # the ensemble's towers, in prediction order
NUM_TOWERS = len(TOWER_NAMES)                      # predictions per request
ATOL = 1e-3                                        # a tower's prediction is correct within this of the target
TARGET_SOURCES = ("model", "file")                 # --targets: the chosen weights' fp32 model, or a stream file's own
