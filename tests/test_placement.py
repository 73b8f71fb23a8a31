"""Towers spread over several devices (issue 15): the placement, and a two-device engine equal to one device's."""
import numpy as np
import pytest
import torch

from client.engine.fast import FastEngine
from client.engine.fast.placement import estimate_ms, place_towers, tower_weight_bytes
from client.engine.precision import DEFAULT_PRECISION, FP32_PRECISION, Precision
from client.model import TOWER_NAMES, load_model


@pytest.fixture(scope="module")
def model():
    return load_model("small", seed=2)[0]


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 6])
def test_every_tower_placed_once_on_at_most_four_devices(model, gpus):
    placement = place_towers(model, DEFAULT_PRECISION, gpus)
    assert len(placement) == min(gpus, 4) and all(placement)
    assert sorted(t for group in placement for t in group) == sorted(TOWER_NAMES)


def test_placement_minimises_the_slowest_device(model):
    sizes = tower_weight_bytes(model)
    best = max(estimate_ms(group, sizes) for group in place_towers(model, DEFAULT_PRECISION, 2))
    xlstm_alone = estimate_ms(["xlstm"], sizes)
    assert best >= xlstm_alone
    assert best <= max(estimate_ms(["xlstm", "hawk"], sizes), estimate_ms(["mamba2", "retnet"], sizes))


def test_weight_bytes_follow_the_precision(model):
    auto, fp32 = tower_weight_bytes(model), tower_weight_bytes(model, FP32_PRECISION)
    assert auto["xlstm"] < fp32["xlstm"]
    # RetNet's input path in fp64 (input_up's and input_down's weights and biases 8 bytes each), the rest fp32
    retnet = TOWER_NAMES.index("retnet")
    input_path = sum(t.numel() for key, t in model.state_dict().items()
                     if key.startswith(f"towers.{retnet}.input_"))
    assert input_path and auto["retnet"] - fp32["retnet"] == 4 * input_path
    # each group at its own dtype: the sLSTM's input maps 4 bytes a weight in auto (split fp16 halves), 2 in fp16
    fp16_maps = tower_weight_bytes(model, Precision.parse("auto,xlstm.slstm_in=fp16"))
    maps = sum(t.numel() for key, t in model.state_dict().items()
               if key.startswith(f"towers.{TOWER_NAMES.index('xlstm')}.") and ".layer.slstm." in key
               and "gate_input." in key)
    assert maps and auto["xlstm"] - fp16_maps["xlstm"] == 2 * maps


def test_two_devices_equal_one_bit_for_bit(model):
    one = FastEngine(model, device="cpu", capacity=6, progress=False)
    two = FastEngine(model, devices=["cpu", "cpu"], capacity=6, progress=False)
    assert len(two.shards) == 2 and sorted(c for s in two.shards for c in s.columns) == [0, 1, 2, 3]
    rng = np.random.default_rng(0)
    for _ in range(12):
        chosen = [f"S{i}" for i in rng.choice(6, int(rng.integers(1, 7)), replace=False)]
        features = rng.standard_normal((len(chosen), 79)).astype(np.float32)
        assert np.array_equal(one.step(chosen, features), two.step(chosen, features))


def test_bad_device_lists_are_clear_errors(model):
    with pytest.raises(ValueError, match="(asked for, but this machine has|CUDA is not available)"):
        FastEngine(model, devices=[f"cuda:{torch.cuda.device_count() + 3}"], progress=False)
    with pytest.raises(ValueError, match="must all be CUDA GPUs or all the CPU"):
        FastEngine(model, devices=["cpu", "meta"], progress=False)
    with pytest.raises(ValueError, match="number of GPUs must be positive"):
        place_towers(model, DEFAULT_PRECISION, 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_submit_like_one_gpu():
    model, _ = load_model("small", seed=2, device="cuda")
    one = FastEngine(model, device="cuda:0", capacity=8, host_symbols=0, progress=False)
    two = FastEngine(model, devices=["cuda:0", "cuda:1"], capacity=8, host_symbols=0, progress=False)
    rng = np.random.default_rng(1)
    pending = []
    for _ in range(30):
        chosen = [f"S{i}" for i in rng.choice(8, int(rng.integers(1, 9)), replace=False)]
        features = rng.standard_normal((len(chosen), 79)).astype(np.float32)
        pending.append((two.submit(chosen, features), one.step(chosen, features)))
    for got, want in pending:
        # the same kernels, each GPU's graphs padded to the same buckets
        np.testing.assert_allclose(got.result(), want, rtol=0, atol=1e-6)
