import torch

# One intra-op thread: the tests run tiny models, where thread hand-offs cost far more than they save
# (20x on a busy 2-core machine).
torch.set_num_threads(1)
