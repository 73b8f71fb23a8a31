"""--precision: the spec grammar, its one-line errors, and the fast engine at each precision against the fp32
reference (on the CPU through the kernels' references; the same code path as on a GPU)."""
import argparse

import numpy as np
import pytest
import torch

from client.engine import make_engine
from client.engine.fast import FastEngine
from client.engine.precision import (DEFAULT_PRECISION, add_precision_argument, describe_precision,
                                     parse_precision, resolve_precision)
from client.engine.reference import ReferenceEngine
from client.model import TOWER_NAMES, load_model
from test_fast_engine import compare

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
AUTO_WITHOUT_HAWK_PARTS = {k: v for k, v in DEFAULT_PRECISION.items() if not k.startswith("hawk.")}


@pytest.mark.parametrize("spec, expected", [
    ("auto", DEFAULT_PRECISION),
    (None, DEFAULT_PRECISION),
    ("bf16", dict.fromkeys(TOWER_NAMES, BF16)),
    ("float16", dict.fromkeys(TOWER_NAMES, F16)),
    (" FP32 ", dict.fromkeys(TOWER_NAMES, F32)),
    ("bf16,retnet=fp32", {"xlstm": BF16, "mamba2": BF16, "retnet": F32, "hawk": BF16}),
    # a tower's own dtype covers all of it: auto's fp32 input_down of Hawk goes too
    ("auto,hawk=bf16,xlstm.mlp=fp32", {**AUTO_WITHOUT_HAWK_PARTS, "hawk": BF16, "xlstm.mlp": F32}),
    ("hawk=bfloat16", {**AUTO_WITHOUT_HAWK_PARTS, "hawk": BF16}),  # overrides alone start from auto
    ("auto,hawk=bf16,hawk.input_down=fp32", {**DEFAULT_PRECISION, "hawk": BF16}),
    ("fp32,retnet=auto,xlstm.mlp=auto", {**dict.fromkeys(TOWER_NAMES, F32), "xlstm.mlp": F16}),
    ("fp16,xlstm=auto", {**dict.fromkeys(TOWER_NAMES, F16), "xlstm.input_down": F32, "xlstm.mlstm_x": F32,
                         "xlstm.mlstm_qkv": F32}),
    ("fp16,xlstm.mlstm_x=fp32", {**dict.fromkeys(TOWER_NAMES, F16), "xlstm.mlstm_x": F32}),
])
def test_specs_parse(spec, expected):
    assert parse_precision(spec) == expected


@pytest.mark.parametrize("spec, match", [
    ("bf17", r"unknown precision 'bf17' as the base; choose one of auto, fp16, bf16, fp32"),
    ("auto,retnt=fp32", r"'retnt' names no tower or part; towers: xlstm \(parts input_down, mlp"),
    ("auto,hawk.attn=fp32", r"'hawk.attn' names no tower or part"),
    ("auto,hawk=fp8", r"unknown precision 'fp8' for hawk"),
    ("auto,hawk", r"must read <tower>=<dtype>"),
    ("auto,,hawk=fp16", r"empty item"),
    ("", r"empty item"),
    # x_proj and gate_proj are one product: fp32 rows may lead fp16 ones, no other mix
    ("bf16,xlstm.mlstm_x=fp32", r"xlstm.mlstm_x and xlstm.mlstm_gate share one product: .* \(got fp32 and bf16\)"),
    ("auto,xlstm.mlstm_gate=fp32,xlstm.mlstm_x=fp16", r"share one product"),
])
def test_bad_specs_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_precision(spec)
    assert "\n" not in str(info.value)


def test_dict_overrides_are_checked():
    assert resolve_precision({"retnet": F16}) == {**DEFAULT_PRECISION, "retnet": F16}
    assert resolve_precision({"hawk": BF16}) == {**AUTO_WITHOUT_HAWK_PARTS, "hawk": BF16}
    assert resolve_precision({"hawk": BF16, "hawk.input_down": F32})["hawk.input_down"] == F32
    with pytest.raises(ValueError, match="names no tower"):
        resolve_precision({"retnt": F32})
    with pytest.raises(ValueError, match="must be torch.float16"):
        resolve_precision({"retnet": torch.int8})
    with pytest.raises(ValueError, match="share one product"):
        resolve_precision({"xlstm": BF16, "xlstm.mlstm_x": F32})


def test_describe_says_what_each_tower_got():
    assert describe_precision("auto") == ("xlstm fp16 (input_down fp32, mlstm_x fp32, mlstm_qkv fp32), mamba2 fp16 "
                                          "(input_down fp32), retnet fp32, hawk fp16 (input_down fp32) "
                                          "(auto: the measured default)")
    assert describe_precision("bf16,xlstm.mlp=fp32") == "xlstm bf16 (mlp fp32), mamba2 bf16, retnet bf16, hawk bf16"


def test_argparse_option_parses_and_reports_errors_in_one_line(capsys):
    parser = argparse.ArgumentParser()
    add_precision_argument(parser)
    assert parser.parse_args([]).precision == DEFAULT_PRECISION
    assert parser.parse_args(["--precision", "bf16,retnet=fp32"]).precision["retnet"] == F32
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "fp8"])
    assert "argument --precision: unknown precision 'fp8'" in capsys.readouterr().err


def test_reference_engine_refuses_another_precision():
    model, _ = load_model("tiny", seed=0)
    assert isinstance(make_engine("reference", model, "cpu", precision="fp32"), ReferenceEngine)
    with pytest.raises(ValueError, match="applies to the fast engine"):
        make_engine("reference", model, "cpu", precision="bf16")


# Worst error over 40 steps of the small preset seen on the CPU, and the bound kept: bf16 keeps 8 bits of mantissa
# (fp16 11), so its products round about 8x coarser.
@pytest.mark.parametrize("spec, bound", [
    ("fp32", 1e-6),             # seen 9e-8
    ("fp16", 1e-3),             # 1.9e-4 (RetNet, which auto keeps in fp32)
    ("bf16", 6e-3),             # 1.6e-3 (RetNet), xLSTM 6.6e-4
    ("bf16,retnet=fp32", 4e-3),  # 1.1e-3 (Mamba2)
    ("auto,hawk=bf16,xlstm.mlp=fp32", 2e-3),  # 5.3e-4 (Hawk)
    ("fp16,xlstm.mlstm_x=fp32", 1e-3),  # x_proj's rows split, gate_proj's fp16, in one product
])
def test_fast_engine_at_each_precision(spec, bound, capsys):
    model, _ = load_model("small", seed=2)
    fast = FastEngine(model, device="cpu", precision=spec)
    chosen = parse_precision(spec)
    assert fast.describe()["precision"] == {k: str(v).removeprefix("torch.") for k, v in chosen.items()}
    assert describe_precision(chosen) in capsys.readouterr().err  # the ready line says what it chose
    err = compare(fast, ReferenceEngine(model, device="cpu"), steps=40, seed=3, n_symbols=4)
    assert np.isfinite(err).all() and err.max() < bound, err.max(0)


def test_stacked_product_of_fp32_then_fp16_rows():
    """layers.Linear of x_proj (fp32) stacked over gate_proj (fp16), on the CPU's cuBLAS-like path: the first
    rows about fp32, the others the fp16 product; the same through the skinny kernel's reference."""
    from client.engine.fast.layers import Linear
    from kernels.skinny_matmul import skinny_matmul_ref
    g = torch.Generator().manual_seed(0)
    first, second, x = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    linear = Linear([first, second], None, [F32, F16], "cpu")
    assert linear.dtype == F32 and linear.nbytes == 80 * 64 * 2 + 48 * 64 * 2  # hi of every row, lo of 48
    y = linear.product(x).double()
    exact = x.double() @ torch.cat([first, second]).double().t()
    assert (y[:, :48] - exact[:, :48]).abs().max() < 1e-5
    fp16 = x.half().double() @ second.half().double().t()
    assert (y[:, 48:] - fp16).abs().max() < 1e-5 and (y[:, 48:] - exact[:, 48:]).abs().max() > 1e-4
    assert torch.allclose(y.float(), skinny_matmul_ref(x, linear.weight, weight_lo=linear.weight_lo), atol=1e-5)
    bias = torch.randn(80, generator=g)
    with_bias = Linear([first, second], bias, [F32, F16], "cpu")
    assert torch.allclose(with_bias(x), y.float() + bias, atol=1e-5)
    assert torch.allclose(with_bias.relu(x), torch.relu(y.float() + bias), atol=1e-5)
    with pytest.raises(ValueError, match="one dtype per stacked weight: 2 weights, 3 dtypes"):
        Linear([first, second], None, [F32, F16, F16], "cpu")
    with pytest.raises(ValueError, match="one dtype, or fp32 then fp16; got bfloat16, float32"):
        Linear([first, second], None, [BF16, F32], "cpu")
    # one fp32 weight already on the device is used in place, not copied (GPU memory the state table keeps)
    assert Linear(first, None, F32, "cpu").weight.data_ptr() == first.data_ptr()
