"""Triton kernels for the fast engine's step, each beside its PyTorch reference.

The state ops update state tables in place over a step's sequences of rows (seq_slots, seq_starts: one
sequence per symbol, its requests in arrival order, kernels/_common.py): each loads a symbol's state once, advances
it through the symbol's rows in order, and stores it once. A table may be a view of a slot-major buffer, and the
three matrix states may be stored in fp16/bf16, rounded to nearest or stochastically (kernels/state_rounding.py).
mlstm_step and retention_step share their matrix-state kernel, outer_product_update. The others fuse the glue
between them; skinny_matmul is the weight product for a step's rows, gemv for one row (or two, the second maybe
unused); copy_words moves a step's inputs and predictions between pinned host memory and the GPU without the copy
engines. `op` runs Triton on CUDA tensors or under TRITON_INTERPRET=1 (read at import) and falls back to `op_ref`
otherwise.
"""
from kernels.add_rms_norm import add_rms_norm, add_rms_norm_ref
from kernels.causal_conv_update import causal_conv_update, causal_conv_update_ref
from kernels.copy_words import copy_words, copy_words_ref
from kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref
from kernels.gemv import gemv, gemv_ref
from kernels.mamba2_update import mamba2_state_update, mamba2_state_update_ref
from kernels.mlstm_input import mlstm_input, mlstm_input_ref
from kernels.mlstm_output import mlstm_output, mlstm_output_ref
from kernels.mlstm_step import mlstm_step, mlstm_step_ref
from kernels.outer_product_update import outer_product_update, outer_product_update_ref
from kernels.retention_step import retention_step, retention_step_ref
from kernels.retnet_output import retnet_output, retnet_output_ref
from kernels.rglru import rglru_step, rglru_step_ref
from kernels.skinny_matmul import skinny_matmul, skinny_matmul_ref
from kernels.slstm_input import slstm_input, slstm_input_ref
from kernels.slstm_output import slstm_output, slstm_output_ref
from kernels.slstm_step import slstm_step, slstm_step_ref
from kernels.state_rounding import StochasticRounding
from kernels.xlstm_residual import xlstm_residual, xlstm_residual_ref

__all__ = [
    "add_rms_norm", "add_rms_norm_ref",
    "causal_conv_update", "causal_conv_update_ref",
    "copy_words", "copy_words_ref",
    "gated_rms_norm", "gated_rms_norm_ref",
    "gemv", "gemv_ref",
    "mamba2_state_update", "mamba2_state_update_ref",
    "mlstm_input", "mlstm_input_ref", "mlstm_step", "mlstm_step_ref",
    "outer_product_update", "outer_product_update_ref",
    "retention_step", "retention_step_ref", "retnet_output", "retnet_output_ref",
    "rglru_step", "rglru_step_ref",
    "skinny_matmul", "skinny_matmul_ref",
    "slstm_input", "slstm_input_ref", "slstm_step", "slstm_step_ref", "slstm_output", "slstm_output_ref",
    "mlstm_output", "mlstm_output_ref", "xlstm_residual", "xlstm_residual_ref",
    "StochasticRounding",
]
