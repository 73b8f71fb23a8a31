"""fp32 device helpers shared by the kernels, written from exp/log only so that they behave the same
compiled and under the Triton interpreter (which lacks libdevice)."""
import triton
import triton.language as tl


@triton.jit
def log1p_exp_neg_abs(x):
    """log(1 + exp(-|x|)) without the cancellation of log(1 + t) for tiny t."""
    t = tl.exp(-tl.abs(x))
    return tl.where(t < 1e-4, t * (1.0 - 0.5 * t), tl.log(1.0 + t))


@triton.jit
def softplus(x):
    # torch's softplus returns x itself above 20
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_exp_neg_abs(x))


@triton.jit
def logsigmoid(x):
    return tl.minimum(x, 0.0) - log1p_exp_neg_abs(x)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))
