"""The step's state kernels and products (Triton) as torch.library custom ops (namespace `fastens`), for
torch.compile.

Each op's real implementation is the public op of its file (Triton on CUDA, the PyTorch reference otherwise); its
fake implementation gives the outputs' shapes and dtypes from the inputs', so Dynamo traces a step with a symbolic
batch size and no graph break. `mutates_args` names the state tables an op updates in place: the compiler orders
the op after every earlier read of them, and calls it on the tables themselves (no copy: the generated code shows).

Tracing rules (registered on import, used only while torch.compile traces; eager calls are untouched):
- the state ops and the products (skinny_matmul, gemv) are traced as their custom ops (opaque to the compiler);
- the glue ops (norms, residual adds, gates) are traced as their PyTorch references, which Inductor fuses. Two of
  them touch state: slstm_input's reference calls causal_conv_update_ref, traced as the custom op too, and
  slstm_output's stores each sequence's last y at its slot without a host sync (store_last_rows), which Inductor
  fuses as a scatter into the table.
So torch.compile of the hand-fused step (client/engine/fast/layers.py) compiles the same code with compiled glue.
"""
from typing import Optional

import torch

import kernels
from kernels.causal_conv_update import causal_conv_update_ref
from kernels.mlstm_input import num_parts
from kernels.state_rounding import StochasticRounding

NAMESPACE = "fastens"


def _empty(*shape, like, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=like.device)


@torch.library.custom_op(f"{NAMESPACE}::causal_conv_update", mutates_args=("conv_state",))
def causal_conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       seq_slots: torch.Tensor, seq_starts: torch.Tensor,
                       activation: Optional[str] = None) -> torch.Tensor:
    return kernels.causal_conv_update(x, conv_state, weight, bias, seq_slots, seq_starts, activation)


@causal_conv_update.register_fake
def _(x, conv_state, weight, bias, seq_slots, seq_starts, activation=None):
    return _empty(*x.shape, like=x)


def _rounding(counter, salt):
    """The state ops' `rounding=` from the custom ops' plain arguments (a custom op takes no named tuple)."""
    return None if counter is None else StochasticRounding(counter, salt)


def _traced_state_op(name):
    """Dynamo traces a state op as its custom op, with `rounding=` passed as (counter, salt)."""
    op = getattr(torch.ops.fastens, name)

    def traced(*args, **kwargs):  # the catch-all signature substitute_in_graph accepts for any original
        rounding = kwargs.pop("rounding", None)
        counter, salt = (None, 0) if rounding is None else rounding
        return op(*args, counter, salt, **kwargs)
    return traced


@torch.library.custom_op(f"{NAMESPACE}::mamba2_state_update", mutates_args=("h",))
def mamba2_state_update(h: torch.Tensor, x: torch.Tensor, t: torch.Tensor, dt_weight: torch.Tensor,
                        dt_bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                        seq_slots: torch.Tensor, seq_starts: torch.Tensor, counter: Optional[torch.Tensor] = None,
                        salt: int = 0) -> torch.Tensor:
    return kernels.mamba2_state_update(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts,
                                       rounding=_rounding(counter, salt))


@mamba2_state_update.register_fake
def _(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, counter=None, salt=0):
    return _empty(*x.shape, like=x)


@torch.library.custom_op(f"{NAMESPACE}::mlstm_input", mutates_args=("conv_state",))
def mlstm_input(xm: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor,
                qkv_weight: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor, seq_slots: torch.Tensor,
                seq_starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels.mlstm_input(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots,
                               seq_starts)


@mlstm_input.register_fake
def _(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts):
    rows, inner = xm.shape
    return (_empty(rows, inner, like=xm), _empty(rows, 3, inner, like=xm),
            _empty(num_parts(inner), rows, gate_weight.shape[0], like=xm))


@torch.library.custom_op(f"{NAMESPACE}::mlstm_step", mutates_args=("C", "n", "m"))
def mlstm_step(C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, ip: torch.Tensor, fp: torch.Tensor, seq_slots: torch.Tensor, seq_starts: torch.Tensor,
               counter: Optional[torch.Tensor] = None, salt: int = 0) -> torch.Tensor:
    return kernels.mlstm_step(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding=_rounding(counter, salt))


@mlstm_step.register_fake
def _(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, counter=None, salt=0):
    return _empty(*q.shape, like=q)


@torch.library.custom_op(f"{NAMESPACE}::retention_step", mutates_args=("S", "scale", "offset"))
def retention_step(S: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, decay: torch.Tensor, angle: torch.Tensor, seq_slots: torch.Tensor,
                   seq_starts: torch.Tensor, counter: Optional[torch.Tensor] = None, salt: int = 0) -> torch.Tensor:
    return kernels.retention_step(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts,
                                  rounding=_rounding(counter, salt))


@retention_step.register_fake
def _(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, counter=None, salt=0):
    return _empty(*q.shape, like=q)


@torch.library.custom_op(f"{NAMESPACE}::rglru_step", mutates_args=("h",))
def rglru_step(gate_pre: torch.Tensor, u: torch.Tensor, i_pre: torch.Tensor, r_pre: torch.Tensor, a: torch.Tensor,
               h: torch.Tensor, seq_slots: torch.Tensor, seq_starts: torch.Tensor, c: float = 8.0) -> torch.Tensor:
    return kernels.rglru_step(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, c)


@rglru_step.register_fake
def _(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, c=8.0):
    return _empty(*u.shape, like=u)


@torch.library.custom_op(f"{NAMESPACE}::slstm_step", mutates_args=("c", "n", "m"))
def slstm_step(xc: torch.Tensor, xn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, c: torch.Tensor,
               n: torch.Tensor, m: torch.Tensor, y: torch.Tensor, seq_slots: torch.Tensor, seq_starts: torch.Tensor,
               max_rows: int = 1, weight_lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    return kernels.slstm_step(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows, weight_lo)


@slstm_step.register_fake
def _(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, max_rows=1, weight_lo=None):
    return _empty(*xc.shape, like=xc)


@torch.library.custom_op(f"{NAMESPACE}::skinny_matmul", mutates_args=())
def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, relu: bool = False,
                  out_dtype: torch.dtype = torch.float32, weight_lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    return kernels.skinny_matmul(x, weight, bias, relu, out_dtype, weight_lo)


@skinny_matmul.register_fake
def _(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None):
    return _empty(x.shape[0], weight.shape[0], like=x, dtype=out_dtype)


def _traced_skinny_matmul(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None,
                          config=None, promote=None):
    if config is not None or promote is not None:  # the op follows default_config and PROMOTE_PARTIALS
        raise ValueError("skinny_matmul's config and promote overrides are for the eager kernel, not torch.compile")
    return torch.ops.fastens.skinny_matmul(x, weight, bias, relu, out_dtype, weight_lo)


@torch.library.custom_op(f"{NAMESPACE}::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, relu: bool = False,
         out_dtype: torch.dtype = torch.float32, weight_lo: Optional[torch.Tensor] = None,
         live_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    return kernels.gemv(x, weight, bias, relu, out_dtype, weight_lo, live_rows)


@gemv.register_fake
def _(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None, live_rows=None):
    return _empty(x.shape[0], weight.shape[0], like=x, dtype=out_dtype)


def _traced_as_op(name):
    op = getattr(torch.ops.fastens, name)

    def traced(*args, **kwargs):
        return op(*args, **kwargs)
    return traced


# public op -> what Dynamo traces in its place
TRACED_AS = {
    **{getattr(kernels, name): _traced_as_op(name) for name in (
        "causal_conv_update", "gemv", "mlstm_input", "rglru_step", "slstm_step")},
    **{getattr(kernels, name): _traced_state_op(name) for name in (
        "mamba2_state_update", "mlstm_step", "retention_step")},
    causal_conv_update_ref: _traced_as_op("causal_conv_update"),
    kernels.skinny_matmul: _traced_skinny_matmul,
    **{getattr(kernels, name): getattr(kernels, name + "_ref") for name in (
        "add_rms_norm", "gated_rms_norm", "xlstm_residual", "mlstm_output", "slstm_output", "slstm_input",
        "retnet_output")},
}
for _original, _traced in TRACED_AS.items():
    torch.compiler.substitute_in_graph(_original)(_traced)
