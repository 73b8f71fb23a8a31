"""Symbols sharded over engine processes (CPU processes here; one per GPU in use): the same predictions as one
engine, symbols placed by load and kept, parts answered as they complete, a failing shard's part alone fails."""
import numpy as np
import pytest
import torch

from client.engine.fast import FastEngine
from client.engine.sharded import ModelSpec, ShardedEngine, ShardError
from client.model import load_model

SPEC = ModelSpec("tiny", seed=3)
CAPACITY = 8  # symbols per shard, no host tier


@pytest.fixture(scope="module")
def sharded():
    engine = ShardedEngine(SPEC, ["cpu", "cpu"], progress=False, capacity=CAPACITY, host_symbols=0)
    yield engine
    engine.close()


def test_two_shards_equal_one_engine(sharded):
    model, _ = load_model("tiny", seed=3)
    single = FastEngine(model, "cpu", capacity=8, progress=False)
    rng = np.random.default_rng(0)
    symbols = [f"S{i}" for i in range(6)]
    for _ in range(5):
        chosen = [str(s) for s in rng.choice(symbols, 4, replace=False)]
        features = rng.standard_normal((4, 79)).astype(np.float32)
        # a shard steps its part of the batch alone, and a product of fewer rows may round differently
        np.testing.assert_allclose(sharded.step(chosen, features), single.step(chosen, features), rtol=0, atol=1e-4)
    counts = np.bincount(list(sharded.shard_of.values()), minlength=2)
    assert counts.sum() == 6 and abs(counts[0] - counts[1]) <= 1  # placed by load, each on one shard


def test_parts_arrive_with_their_rows(sharded):
    features = np.random.default_rng(1).standard_normal((3, 79)).astype(np.float32)
    pending = sharded.submit(["P0", "P1", "P2"], features)
    rows = sorted(int(r) for part_rows, outcome in pending.parts() for r in part_rows)
    assert rows == [0, 1, 2]
    assert pending.result().shape == (3, 4)


def test_a_shard_without_room_fails_its_part_alone(sharded):
    features = np.zeros((1, 79), np.float32)
    held = sum(shard == 0 for shard in sharded.shard_of.values())
    for i in range(CAPACITY - held):  # fill shard 0
        sharded.shard_of[f"F{i}"] = 0
        sharded.step([f"F{i}"], features)
    sharded.shard_of["NEW"] = 0
    sharded.shard_of["OTHER"] = 1
    pending = sharded.submit(["NEW", "OTHER"], np.zeros((2, 79), np.float32))
    outcomes = {int(rows[0]): outcome for rows, outcome in pending.parts()}
    assert isinstance(outcomes[0], ShardError) and "no room for the state" in str(outcomes[0])
    assert outcomes[1].shape == (1, 4)  # the other shard's part is answered
    with pytest.raises(ShardError, match="no room"):
        pending.result()
    assert sharded.step(["F0"], features).shape == (1, 4)  # the full shard still serves its symbols


def test_release_frees_a_symbol_everywhere(sharded):
    sharded.step(["R0"], np.zeros((1, 79), np.float32))
    sharded.release(["R0", "never-seen"])
    assert "R0" not in sharded.symbols


def test_missing_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"asked for, but this machine has \d+ GPU"):
        ShardedEngine(SPEC, ["cuda:7"], progress=False)


def test_shard_that_cannot_start_says_why():
    with pytest.raises(ShardError, match="failed to start: cpu: ValueError: unknown preset"):
        ShardedEngine(ModelSpec("huge"), ["cpu"], progress=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_shards_serve_like_one_engine():
    model, _ = load_model("small", seed=3, device="cuda")
    single = FastEngine(model, "cuda", capacity=16, progress=False)
    engine = ShardedEngine(ModelSpec("small", seed=3), ["cuda:0", "cuda:1"], progress=False, capacity=16)
    try:
        rng = np.random.default_rng(2)
        for _ in range(10):
            chosen = [f"S{i}" for i in rng.choice(16, 12, replace=False)]
            features = rng.standard_normal((12, 79)).astype(np.float32)
            np.testing.assert_allclose(engine.step(chosen, features), single.step(chosen, features), rtol=0, atol=2e-4)
        assert sorted(set(engine.shard_of.values())) == [0, 1]
    finally:
        engine.close()
