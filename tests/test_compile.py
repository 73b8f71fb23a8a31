"""The torch.compile path: the custom ops of kernels/custom_ops.py (opcheck, fake shapes with a symbolic batch), the
compiled engine against the hand-fused one and the fp32 reference (tiny preset on the CPU, where Inductor compiles
C++; small preset inside CUDA graphs on a GPU), and its one-line error where torch.compile cannot run."""
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import kernels.custom_ops  # noqa: F401  (registers the fastens ops)
from client.engine import make_engine
from client.engine.fast import FastEngine
from client.engine.fast import compiled
from client.engine.precision import FP32_PRECISION
from client.engine.reference import ReferenceEngine
from client.model import load_model
from kernels._common import plan
from kernels.mlstm_input import pack_qkv_weight
from kernels.skinny_matmul import split_fp16
from test_fast_engine import compare, random_steps
from test_kernels import SMALL_DIMS, make_args, slot_args

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# On a CPU Inductor compiles C++: without a compiler FastEngine(compile=True) raises CompileUnavailable (tested
# below with a stand-in failure), and the engine tests cannot run.
needs_compiler = pytest.mark.skipif(not HAS_CUDA and shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="Inductor needs a C++ compiler on the CPU")


def op_cases(rows=3, device=DEVICE):
    """(op name, kwargs) of one small call of every fastens op; slots distinct."""
    slots = [4, 1, 2][:rows]
    cases = []
    for name in ("causal_conv_update", "mamba2_state_update", "retention_step", "mlstm_step", "slstm_step",
                 "rglru_step"):
        args = make_args(name, rows, 6, SMALL_DIMS[name][0], device=device)
        cases.append((name, {**args, **slot_args(name, slots, device=device)}))
    # several rows per sequence and an empty one, every row live: a padding row's output is left unwritten, so
    # opcheck's eager and traced runs may differ there (on a GPU they did); padding is kept off the states in
    # tests/test_kernels.py and the ragged kernel tests
    seq_slots, seq_starts = plan([4, 1, 2][:rows], [rows - 1, 0, 1][:rows], 3, device)
    for name in ("causal_conv_update", "mamba2_state_update", "retention_step", "mlstm_step", "slstm_step",
                 "rglru_step"):
        args = make_args(name, rows, 6, SMALL_DIMS[name][0], device=device)
        extra = dict(max_rows=rows - 1) if name == "slstm_step" else {}
        cases.append((name, {**args, "seq_slots": seq_slots, "seq_starts": seq_starts, **extra}))
    g = torch.Generator().manual_seed(0)
    inner, gates = 32, 4
    mlstm_input = dict(xm=torch.randn(rows, inner, generator=g), conv_state=torch.randn(6, inner, 3, generator=g),
                       conv_weight=torch.randn(inner, 4, generator=g), conv_bias=torch.randn(inner, generator=g),
                       qkv_weight=pack_qkv_weight(*torch.randn(3, inner // 4, 4, 4, generator=g)),
                       gate_weight=torch.randn(gates, 3 * inner, generator=g),
                       gate_bias=torch.randn(gates, generator=g))
    cases.append(("mlstm_input", {**{k: v.to(device) for k, v in mlstm_input.items()},
                                  **slot_args("mlstm_input", slots, device=device)}))
    x, w, b = (t.to(device) for t in (torch.randn(rows, 64, generator=g), torch.randn(48, 64, generator=g) / 8,
                                      torch.randn(48, generator=g)))
    hi, lo = split_fp16(w)
    cases.append(("skinny_matmul", dict(x=x, weight=w.half(), bias=b, relu=True, out_dtype=torch.float16)))
    cases.append(("skinny_matmul", dict(x=x, weight=hi, weight_lo=lo)))
    return cases


@pytest.mark.parametrize("name, kwargs", op_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_custom_ops_pass_opcheck(name, kwargs):
    """Schema (the mutated arguments are the declared ones), fake against real outputs, and AOT dispatch with
    dynamic shapes."""
    torch.library.opcheck(getattr(torch.ops.fastens, name), (), kwargs)


@pytest.mark.parametrize("name, kwargs", op_cases(device="cpu"), ids=lambda v: v if isinstance(v, str) else "")
def test_fake_impls_keep_a_symbolic_batch(name, kwargs):
    """Traced with symbolic shapes, every output's batch dimension is the input batch's symbol, not a number."""
    op = getattr(torch.ops.fastens, name)
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    options = {k: v for k, v in kwargs.items() if k not in keys}
    graph = make_fx(lambda *tensors: op(**dict(zip(keys, tensors)), **options), tracing_mode="symbolic")(
        *(kwargs[k] for k in keys))
    batch_input = next(k for k in ("x", "xm", "q", "xc", "u") if k in keys)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    batch = placeholders[keys.index(batch_input)].meta["val"].shape[0]
    assert isinstance(batch, torch.SymInt)
    outputs = [n for n in graph.graph.nodes if n.op == "output"][0].args[0]
    for out in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
        shape = out.meta["val"].shape
        assert str(batch) in {str(s) for s in shape}, (name, shape)


def test_compile_unavailable_is_a_one_line_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in\ntorch._inductor.config.cpp.cxx")

    model, _ = load_model("tiny", seed=0)
    monkeypatch.setattr(compiled, "_COMPILE_RUNS", set())  # forget an earlier test's working probe
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(compiled.CompileUnavailable, match="torch.compile does not run on cpu") as info:
        FastEngine(model, device="cpu", compile=True, progress=False)
    assert "\n" not in str(info.value) and "run without --compile" in str(info.value)
    monkeypatch.delattr(torch.compiler, "substitute_in_graph")
    with pytest.raises(compiled.CompileUnavailable, match=r"needs torch >= 2.7 \(torch.compiler.substitute_in_graph"):
        FastEngine(model, device="cpu", compile=True, progress=False)


def test_reference_engine_refuses_compile():
    model, _ = load_model("tiny", seed=0)
    with pytest.raises(ValueError, match="--compile applies to the fast engine"):
        make_engine("reference", model, "cpu", compile=True)


def _graphs():
    return counters["stats"]["unique_graphs"]


@needs_compiler
def test_compiled_engine_in_fp32_matches_the_reference():
    """The compiled glue in fp32 computes the reference's function; the engine compiles up front (B = 1, 2, more)
    and never again, also when states move through the host tier (the same holds for a capture on a GPU)."""
    model, _ = load_model("tiny", seed=1)
    fast = FastEngine(model, device="cpu", precision=FP32_PRECISION, compile=True, max_batch=6, capacity=3,
                      host_symbols=6, progress=False)
    assert fast.describe()["compile"] and fast.describe()["compile_s"] > 0
    graphs = _graphs()
    err = compare(fast, ReferenceEngine(model, device="cpu"), steps=16)
    assert err.max() < 2e-6, err.max(0)
    assert fast.table.stats["restored"] > 0 and _graphs() == graphs
    assert not counters["graph_break"]


@needs_compiler
def test_compiled_engine_at_the_default_precision_holds_atol():
    model, _ = load_model("tiny", seed=1)
    compiled_engine = FastEngine(model, device="cpu", compile=True, max_batch=6, progress=False)
    hand_fused = FastEngine(model, device="cpu", max_batch=6, progress=False)
    ref = ReferenceEngine(model, device="cpu")
    worst_ref = worst_hand = 0.0
    for chosen, feats in random_steps(5, 16, [f"S{i}" for i in range(6)]):
        got = compiled_engine.step(chosen, feats)
        worst_ref = max(worst_ref, float(np.abs(got - ref.step(chosen, feats)).max()))
        worst_hand = max(worst_hand, float(np.abs(got - hand_fused.step(chosen, feats)).max()))
    assert worst_ref <= 1e-3 and worst_hand <= 5e-4, (worst_ref, worst_hand)


@needs_compiler
def test_compile_bench_measures_both_paths():
    """scripts/compile_bench.py's measurement, in this process (a child's work) on the tiny preset, and its summary;
    the graphs are those the tests above compiled, so nothing compiles here."""
    spec = importlib.util.spec_from_file_location("compile_bench", REPO / "scripts" / "compile_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    settings = dict(preset="tiny", seed=0, device="cpu", batches=[1, 3], iters=2, warmup=1, precision="auto",
                    engines=["compiled", "hand_fused"], time_steps=True)
    cold = bench.measure_in_child(settings)
    assert cold["graphs_after_steps"] == cold["compiled_graphs"] and cold["compile_s"] > 0
    for row in cold["steps"].values():
        assert row["compiled"]["median_ms"] > 0 and row["hand_fused"]["p99_ms"] > 0 and row["max_abs_diff"] < 1e-3
    hand_fused_cold = bench.measure_in_child({**settings, "engines": ["hand_fused"], "time_steps": False})
    assert "steps" not in hand_fused_cold and hand_fused_cold["hand_fused_startup_s"] > 0
    table = bench.summary({**settings, "cold": cold, "warm": cold, "hand_fused_cold": hand_fused_cold})
    assert "startup, cold cache: compiled" in table and "| 3 (warm) |" in table


@cuda
def test_compiled_graphs_equal_the_hand_fused_graphs_on_gpu():
    """Both engines inside their CUDA graphs at B = 1, 20, 64 (small preset); nothing compiles after the engine's
    warm-up: not in its captures, nor when states move through the host tier."""
    model, _ = load_model("small", seed=0, device="cuda")
    hand_fused = FastEngine(model, device="cuda", capacity=64, host_symbols=0, progress=False)
    compiled_engine = FastEngine(model, device="cuda", compile=True, capacity=64, host_symbols=64, progress=False)
    graphs = _graphs()
    rng = np.random.default_rng(0)
    for batch in (1, 20, 64):
        symbols = [f"S{i}" for i in range(batch)]
        for _ in range(3):
            feats = rng.standard_normal((batch, 79)).astype(np.float32)
            diff = np.abs(compiled_engine.step(symbols, feats) - hand_fused.step(symbols, feats)).max()
            assert diff < 5e-4, (batch, diff)
    assert _graphs() == graphs
