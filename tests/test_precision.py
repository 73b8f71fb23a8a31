"""--precision and --state-dtype: the spec grammars, their one-line errors, the values they parse to, the weight
groups' one table, and the fast engine at each precision against the fp32 reference (on the CPU through the kernels'
references; the same code path as on a GPU)."""
import argparse
import pickle

import numpy as np
import pytest
import torch

from client.engine import make_engine
from client.engine.fast import FastEngine
from client.engine.fast.placement import weight_group_of
from client.engine.options import add_engine_arguments, engine_options
from client.engine.precision import (DEFAULT_PRECISION, FP32_PRECISION, WEIGHT_GROUPS, Precision, StateStorage,
                                     add_precision_argument)
from client.engine.reference import ReferenceEngine
from client.model import TOWER_NAMES, load_model
from test_fast_engine import compare

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
AUTO = DEFAULT_PRECISION.as_dict()
AUTO_WITHOUT_HAWK_PARTS = {k: v for k, v in AUTO.items() if not k.startswith("hawk.")}
AUTO_WITHOUT_XLSTM_PARTS = {k: v for k, v in AUTO.items() if not k.startswith("xlstm.")}


@pytest.mark.parametrize("spec, expected", [
    ("auto", AUTO),
    (None, AUTO),
    ("bf16", dict.fromkeys(TOWER_NAMES, BF16)),
    ("float16", dict.fromkeys(TOWER_NAMES, F16)),
    (" FP32 ", dict.fromkeys(TOWER_NAMES, F32)),
    ("bf16,retnet=fp32", {"xlstm": BF16, "mamba2": BF16, "retnet": F32, "hawk": BF16}),
    # a tower's own dtype covers all of it: auto's fp32 input_down of Hawk goes too
    ("auto,hawk=bf16,xlstm.mlp=fp32", {**AUTO_WITHOUT_HAWK_PARTS, "hawk": BF16, "xlstm.mlp": F32}),
    ("hawk=bfloat16", {**AUTO_WITHOUT_HAWK_PARTS, "hawk": BF16}),  # overrides alone start from auto
    ("auto,hawk=bf16,hawk.input_down=fp32", {**AUTO, "hawk": BF16}),
    ("fp32,retnet=auto,xlstm.mlp=auto", {**dict.fromkeys(TOWER_NAMES, F32), "retnet.input_down": F64,
                                         "xlstm.mlp": F16}),
    # an input path in fp64, or RetNet's back to fp32
    ("auto,retnet.input_down=fp32", {k: v for k, v in AUTO.items() if k != "retnet.input_down"}),
    ("bf16,hawk.input_down=float64", {**dict.fromkeys(TOWER_NAMES, BF16), "hawk.input_down": F64}),
    ("fp16,xlstm=auto", {**dict.fromkeys(TOWER_NAMES, F16), "xlstm.input_down": F32, "xlstm.slstm_in": F32,
                         "xlstm.mlstm_x": F32, "xlstm.mlstm_qkv": F32}),
    # the sLSTM's input maps apart from its state maps: back to fp16 alone, or with them through the tower's dtype
    ("auto,xlstm.slstm_in=fp16", {k: v for k, v in AUTO.items() if k != "xlstm.slstm_in"}),
    ("auto,xlstm=fp16", {**AUTO_WITHOUT_XLSTM_PARTS, "xlstm": F16}),
    ("auto,xlstm.slstm=fp32", {**AUTO, "xlstm.slstm": F32}),
    ("fp16,xlstm.mlstm_x=fp32", {**dict.fromkeys(TOWER_NAMES, F16), "xlstm.mlstm_x": F32}),
    ("fp16,xlstm.mlp=fp16", dict.fromkeys(TOWER_NAMES, F16)),  # a group given its tower's dtype is no exception
])
def test_specs_parse(spec, expected):
    assert Precision.parse(spec).as_dict() == expected


@pytest.mark.parametrize("spec, match", [
    ("bf17", r"unknown precision 'bf17' as the base; choose one of auto, fp16, bf16, fp32"),
    ("auto,retnt=fp32", r"'retnt' names no tower or part; towers: xlstm \(parts input_down, mlp"),
    ("auto,hawk.attn=fp32", r"'hawk.attn' names no tower or part"),
    ("auto,hawk.=fp32", r"'hawk.' names no tower or part"),  # no part after the dot: it was dropped unsaid
    ("xlstm.=bf16", r"'xlstm.' names no tower or part"),
    ("auto,hawk=fp8", r"unknown precision 'fp8' for hawk"),
    ("fp64", r"fp64 as the base is not offered: only a tower's input path takes it"),
    ("auto,retnet=fp64", r"fp64 for retnet is not offered"),
    ("auto,hawk.mlp=float64", r"fp64 for hawk.mlp is not offered"),
    ("auto,hawk", r"must read <tower>=<dtype>"),
    ("auto,,hawk=fp16", r"empty item"),
    ("", r"empty item"),
    # x_proj and gate_proj are one product: fp32 rows may lead fp16 ones, no other mix
    ("bf16,xlstm.mlstm_x=fp32", r"xlstm.mlstm_x and xlstm.mlstm_gate share one product: .* \(got fp32 and bf16\)"),
    ("auto,xlstm.mlstm_gate=fp32,xlstm.mlstm_x=fp16", r"share one product"),
    # the sLSTM's eight maps are one weight too: fp32 input maps split over fp16 state maps, or one dtype
    ("auto,xlstm.slstm=bf16", r"xlstm.slstm_in and xlstm.slstm share one product: .* \(got fp32 and bf16\)"),
    ("fp16,xlstm.slstm=fp32", r"xlstm.slstm_in and xlstm.slstm share one product: .* \(got fp16 and fp32\)"),
])
def test_bad_specs_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        Precision.parse(spec)
    assert "\n" not in str(info.value)


def test_a_precision_is_a_value():
    """Equal by what each weight group gets, whatever the spec said; the spec kept for names; picklable (the
    sharded engine sends it to its processes)."""
    spelled_out = Precision.parse("fp16,retnet=fp32,retnet.input_down=fp64,xlstm.input_down=fp32,xlstm.slstm_in=fp32,"
                                  "xlstm.mlstm_x=fp32,xlstm.mlstm_qkv=fp32,mamba2.input_down=fp32,hawk.input_down=fp32")
    assert spelled_out == DEFAULT_PRECISION and hash(spelled_out) == hash(DEFAULT_PRECISION)
    assert spelled_out.spec.startswith("fp16,retnet") and str(DEFAULT_PRECISION) == "auto"
    assert Precision.parse("bf16") != FP32_PRECISION
    assert pickle.loads(pickle.dumps(DEFAULT_PRECISION)) == DEFAULT_PRECISION
    assert DEFAULT_PRECISION.dtype_of("xlstm", "mlstm_x") == F32 and DEFAULT_PRECISION.dtype_of("xlstm", "mlp") == F16
    assert DEFAULT_PRECISION.dtype_of("retnet") == F32
    assert DEFAULT_PRECISION.dtype_of("xlstm", "slstm_in") == F32
    assert DEFAULT_PRECISION.dtype_of("xlstm", "slstm") == F16
    with pytest.raises(KeyError, match="no weight group 'attn'"):
        DEFAULT_PRECISION.dtype_of("hawk", "attn")


def test_weight_groups_are_the_engines_and_the_placements():
    """The one table of weight groups: the engine's blocks ask for exactly its groups, and each group lies on some
    weights of the tower's state dict (placement.py counts their bytes)."""
    model, _ = load_model("tiny", seed=0)

    class Recording(Precision):
        def dtype_of(self, tower, group=None):
            asked.setdefault(tower, set()).add(group)
            return super().dtype_of(tower, group)

    asked = {}
    FastEngine(model, device="cpu", precision=Recording(DEFAULT_PRECISION.dtypes), capacity=1, progress=False)
    assert asked == {tower: set(groups) for tower, groups in WEIGHT_GROUPS.items()}
    keys = list(model.state_dict())
    for index, tower in enumerate(TOWER_NAMES):
        found = {weight_group_of(tower, key) for key in keys if key.startswith(f"towers.{index}.")}
        assert found - {None} == set(WEIGHT_GROUPS[tower]), tower
    # a key lies in the first group naming a part of it: the sLSTM's input maps in slstm_in, the rest in slstm
    slstm = {key: weight_group_of("xlstm", key) for key in keys if ".layer.slstm." in key}
    assert {key for key, group in slstm.items() if group == "slstm_in"} == {key for key in slstm
                                                                            if "gate_input." in key}
    assert set(slstm.values()) == {"slstm_in", "slstm"}


def test_describe_says_what_each_tower_got():
    assert DEFAULT_PRECISION.describe() == ("xlstm fp16 (input_down fp32, slstm_in fp32, mlstm_x fp32, "
                                            "mlstm_qkv fp32), mamba2 fp16 (input_down fp32), retnet fp32 (input_down "
                                            "fp64), hawk fp16 "
                                            "(input_down fp32) (auto: the measured default)")
    assert Precision.parse("bf16,xlstm.mlp=fp32").describe() == ("xlstm bf16 (mlp fp32), mamba2 bf16, retnet bf16, "
                                                                 "hawk bf16")


def test_argparse_option_parses_and_reports_errors_in_one_line(capsys):
    parser = argparse.ArgumentParser()
    add_precision_argument(parser)
    assert parser.parse_args([]).precision == DEFAULT_PRECISION
    assert parser.parse_args(["--precision", "bf16,retnet=fp32"]).precision.dtype_of("retnet") == F32
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "fp8"])
    assert "argument --precision: unknown precision 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("spec, rounding, dtypes, rounded", [
    ("fp32", None, (F32, F32, F32), "stochastic"),
    ("fp16", None, (F16, F16, F32), "stochastic"),  # RetNet's S stays fp32 unless named
    ("bf16:nearest", None, (BF16, BF16, F32), "nearest"),
    ("fp16,retnet=fp16", "nearest", (F16, F16, F16), "nearest"),
    ("float16:stochastic", "stochastic", (F16, F16, F32), "stochastic"),
])
def test_state_storage_specs_parse(spec, rounding, dtypes, rounded):
    storage = StateStorage.parse(spec, rounding)
    assert tuple(storage.dtype_of(tower) for tower in ("xlstm", "mamba2", "retnet")) == dtypes
    assert storage.dtype_of("hawk") == F32 and storage.rounding == rounded and storage.spec == spec
    assert storage.sixteen_bit == (dtypes != (F32, F32, F32))


@pytest.mark.parametrize("spec, rounding, match", [
    ("fp9", None, "unknown state dtype 'fp9'"),
    ("fp16,hawk=fp16", None, "must read <tower>=<dtype> with a tower of xlstm, mamba2, retnet"),
    ("fp16:up", None, "state rounding must be nearest or stochastic, got 'up'"),
    ("fp16", "up", "state rounding must be nearest or stochastic, got 'up'"),
    ("fp16:nearest", "stochastic", "says nearest rounding, and the rounding given is stochastic"),
    ("fp32", "nearest", "--state-rounding nearest applies to 16-bit state"),
    ("fp32:stochastic", None, "--state-rounding stochastic applies to 16-bit state"),
])
def test_bad_state_storage_is_a_one_line_error(spec, rounding, match):
    with pytest.raises(ValueError, match=match):
        StateStorage.parse(spec, rounding)


def test_engine_options_carry_the_parsed_values():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--precision", "bf16", "--state-dtype", "fp16",
                                                "--state-rounding", "nearest"]))
    assert options["precision"] == Precision.parse("bf16")
    assert options["state_storage"] == StateStorage.parse("fp16", "nearest")
    assert engine_options(parser.parse_args([]))["state_storage"] == StateStorage.parse("fp32")


def test_reference_engine_refuses_another_precision():
    model, _ = load_model("tiny", seed=0)
    assert isinstance(make_engine("reference", model, "cpu", precision=FP32_PRECISION), ReferenceEngine)
    with pytest.raises(ValueError, match="applies to the fast engine"):
        make_engine("reference", model, "cpu", precision=Precision.parse("bf16"))


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
    chosen = Precision.parse(spec)
    fast = FastEngine(model, device="cpu", precision=chosen)
    assert fast.describe()["precision"] == {k: str(v).removeprefix("torch.") for k, v in chosen.as_dict().items()}
    assert chosen.describe() in capsys.readouterr().err  # the ready line says what it chose
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


def test_an_fp64_input_path_rounds_once_and_leaves_the_other_towers_as_they_were():
    """auto's RetNet input path: relu(input_up) and input_down in fp64 from the fp32 weights, rounded to fp32 once
    (bias included); the other towers' inputs bit for bit those of the fp32 product they share."""
    from client.engine.fast.runner import StepRunner
    model, _ = load_model("tiny", seed=0)
    sd = model.state_dict()
    features = torch.from_numpy(np.random.default_rng(0).lognormal(8.0, 2.0, (3, 79)).astype(np.float32))
    auto = StepRunner(model, "cpu")
    fp32 = StepRunner(model, "cpu", Precision.parse("auto,retnet.input_down=fp32"))
    retnet = TOWER_NAMES.index("retnet")
    inputs, inputs32 = auto.tower_inputs(features), fp32.tower_inputs(features)
    p = f"towers.{retnet}."
    up = torch.relu(features.double() @ sd[p + "input_up.weight"].double().t() + sd[p + "input_up.bias"].double())
    assert inputs[retnet].dtype == torch.float64 and torch.equal(inputs[retnet], up)
    x0 = (up @ sd[p + "input_down.weight"].double().t() + sd[p + "input_down.bias"].double()).float()
    assert torch.equal(auto.towers[retnet].input_down(inputs[retnet]).float(), x0)
    for tower in range(len(TOWER_NAMES)):
        if tower != retnet:
            assert inputs[tower].dtype == torch.float32 and torch.equal(inputs[tower], inputs32[tower])
    assert inputs32[retnet].dtype == torch.float32 and auto.weight_bytes > fp32.weight_bytes


def test_fp32_products_hold_until_the_last_thread_leaves():
    """Threads entering and leaving fp32_products interleaved (runner.precompile's, shards', a reference beside an
    engine): the settings stay fp32 while any is inside, and the process's own come back after the last."""
    import threading

    from client.engine.precision import fp32_products

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn

    def flags():
        return matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction

    before = flags()
    matmul.allow_tf32 = cudnn.allow_tf32 = matmul.allow_fp16_reduced_precision_reduction = True
    try:
        first_in, first_may_leave, first_left = threading.Event(), threading.Event(), threading.Event()
        seen = []

        def first():
            with fp32_products():
                first_in.set()
                first_may_leave.wait(10)
            first_left.set()

        thread = threading.Thread(target=first)
        thread.start()
        first_in.wait(10)
        with fp32_products():  # entered after the first, left after it
            first_may_leave.set()
            first_left.wait(10)
            seen.append(flags())
        thread.join(10)
        assert seen == [(False, False, False)] and flags() == (True, True, True)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = before
