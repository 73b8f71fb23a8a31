"""fp32 device helpers shared by the kernels, written from exp/log only so that they behave the same
compiled and under the Triton interpreter (which lacks libdevice)."""
import triton
import triton.language as tl


@triton.jit
def log1p_exp_neg_abs(x):
    """log(1 + exp(-|x|)). log(1 + t) loses the low bits of small t, so below t = 0.1 use the series
    (truncated after t^7: relative error < 2e-8)."""
    t = tl.exp(-tl.abs(x))
    series = t * (1.0 + t * (-0.5 + t * (1.0 / 3 + t * (-0.25 + t * (0.2 + t * (-1.0 / 6 + t * (1.0 / 7)))))))
    return tl.where(t < 0.1, series, tl.log(1.0 + t))


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


@triton.jit
def tanh(x):
    """tanh from exp of a non-positive argument (no overflow, exact sign); below |x| = 0.1, where
    1 - exp(-2|x|) cancels, the series (truncated after x^7: relative error < 1e-10)."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315))))
    return tl.where(ax < 0.1, series, tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t))
