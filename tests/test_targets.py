import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from client.model import load_model
from client import targets as targets_module
from client.streams import Stream, generate_stream, stream_fingerprint
from client.targets import (compute_targets, default_cache_dir, model_code_version, source_digest, targets_cache_path,
                            targets_fingerprint)
from conftest import checkout_env

ROOT = Path(__file__).resolve().parent.parent


class CountingModel(nn.Module):
    """Wraps a model and counts its steps, to tell a cache hit (no steps) from a miss."""

    def __init__(self, model):
        super().__init__()
        self.model, self.steps = model, 0

    def init_state(self, batch, device=None):
        return self.model.init_state(batch, device=device)

    def forward(self, features, state):
        self.steps += 1
        return self.model(features, state)


class NaNAfterThreeSteps(CountingModel):
    def forward(self, features, state):
        prediction, state = super().forward(features, state)
        return (prediction * float("nan") if self.steps > 3 else prediction), state


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    # The tiny model's steps are far too small to gain from threads, and on a busy 2-core machine
    # contending threads make each step ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_and_fingerprint():
    return load_model("tiny", seed=0)


def run_each_symbol_alone(model, stream):
    expected = np.empty((len(stream), 4), dtype=np.float32)
    states = {}
    with torch.inference_mode():
        for row, symbol in enumerate(stream.symbols.tolist()):
            state = states[symbol] if symbol in states else model.init_state(1, device=torch.device("cpu"))
            prediction, states[symbol] = model(torch.from_numpy(stream.features[row:row + 1]), state)
            expected[row] = prediction[0].numpy()
    return expected


def uneven_stream():
    """Symbols with very different request counts, interleaved: active rows shrink step by step."""
    base = generate_stream(5, 60, seed=11)
    symbols = base.symbols.copy()
    symbols[::4] = "SYM_000"
    symbols[-1] = "SYM_LONE"
    return Stream(symbols, base.features, base.delay_ms)


def test_targets_equal_each_symbol_run_alone(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    stream = uneven_stream()
    targets = compute_targets(model, stream, fingerprint, device="cpu", cache_dir=tmp_path, progress=False)
    assert targets.dtype == np.float32 and targets.shape == (len(stream), 4)
    np.testing.assert_allclose(targets, run_each_symbol_alone(model, stream), rtol=1e-5, atol=1e-6)


def test_symbols_run_in_groups_whose_state_fits_the_budget(model_and_fingerprint, tmp_path, monkeypatch, capsys):
    model, fingerprint = model_and_fingerprint
    per_symbol = sum(t.numel() * t.element_size() for t in model.init_state(1).values())
    monkeypatch.setattr(targets_module, "STATE_BUDGET_BYTES", 2 * per_symbol)
    stacked = []

    class RecordingModel(CountingModel):
        def init_state(self, batch, device=None):
            stacked.append(batch)
            return super().init_state(batch, device)

    stream = uneven_stream()  # 6 symbols: three groups of two
    targets = compute_targets(RecordingModel(model), stream, fingerprint, device="cpu", cache_dir=tmp_path)
    np.testing.assert_allclose(targets, run_each_symbol_alone(model, stream), rtol=1e-5, atol=1e-6)
    assert [batch for batch in stacked if batch > 1] == [2, 2, 2]
    _, counts = np.unique(stream.symbols, return_counts=True)
    steps = sum(counts[g:g + 2].max() for g in range(0, 6, 2))
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"targets: {steps}/{steps} steps")


def test_second_call_hits_the_cache(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    stream = generate_stream(3, 12, seed=1)
    counting = CountingModel(model)
    first = compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    assert counting.steps > 0
    assert targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream)).is_file()
    counting.steps = 0
    second = compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    assert counting.steps == 0
    np.testing.assert_array_equal(first, second)
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".npy"]  # no temporary left behind


def test_cache_misses_when_weights_or_stream_change(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    counting = CountingModel(model)
    stream = generate_stream(3, 12, seed=1)
    compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    for weights, changed_stream in [("other-weights", stream), (fingerprint, generate_stream(3, 12, seed=2))]:
        counting.steps = 0
        compute_targets(counting, changed_stream, weights, cache_dir=tmp_path, progress=False)
        assert counting.steps > 0
    assert len(list(tmp_path.glob("*.npy"))) == 3


def test_cache_misses_when_the_model_code_changes(model_and_fingerprint, tmp_path, monkeypatch):
    model, fingerprint = model_and_fingerprint
    counting = CountingModel(model)
    stream = generate_stream(3, 12, seed=1)
    key = targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream))
    assert targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream)) == key
    compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(targets_module, "model_code_version", lambda: "another version of client/model/")
    assert targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream)) != key
    counting.steps = 0
    compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    assert counting.steps > 0 and len(list(tmp_path.glob("*.npy"))) == 2


def test_the_model_code_version_is_of_the_sources_contents_alone(tmp_path):
    copy = shutil.copytree(ROOT / "client" / "model", tmp_path / "elsewhere" / "model",
                           ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.iterdir():
        os.utime(path, (0, 0))
    assert source_digest(copy) == model_code_version()  # another folder, other mtimes: the same version
    child = subprocess.run([sys.executable, "-c", "from client.targets import model_code_version as v; print(v())"],
                           capture_output=True, text=True, cwd=tmp_path, env=checkout_env(ROOT, PYTHONHASHSEED="1"),
                           timeout=120)
    assert child.stdout.strip() == model_code_version(), child.stderr  # and in another process
    with open(copy / "hawk.py", "a") as file:
        file.write("\n")
    assert source_digest(copy) != model_code_version()


def test_a_corrupt_cache_entry_is_recomputed(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    stream = generate_stream(2, 6, seed=1)
    expected = compute_targets(model, stream, fingerprint, cache_dir=tmp_path, progress=False)
    path = targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream))
    path.write_bytes(b"truncated")
    np.testing.assert_array_equal(compute_targets(model, stream, fingerprint, cache_dir=tmp_path,
                                                  progress=False), expected)
    assert np.load(path).shape == (6, 4)


def npz_of(**arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("damage", [
    lambda path: path.write_bytes(b""),  # a rename that reached the disk before the data did
    lambda path: path.write_bytes(npz_of(targets=np.zeros((6, 4), np.float32))),
    lambda path: np.save(path, np.full((6, 4), np.nan, np.float32)),
])
def test_an_empty_foreign_or_non_finite_cache_entry_is_recomputed(model_and_fingerprint, tmp_path, damage):
    model, fingerprint = model_and_fingerprint
    stream = generate_stream(2, 6, seed=1)
    expected = compute_targets(model, stream, fingerprint, cache_dir=tmp_path, progress=False)
    damage(targets_cache_path(tmp_path, fingerprint, stream_fingerprint(stream)))
    np.testing.assert_array_equal(compute_targets(model, stream, fingerprint, cache_dir=tmp_path,
                                                  progress=False), expected)


def test_targets_that_cannot_be_cached_are_still_returned(model_and_fingerprint, tmp_path, capsys):
    model, fingerprint = model_and_fingerprint
    stream = generate_stream(2, 6, seed=1)
    expected = compute_targets(model, stream, fingerprint, cache_dir=tmp_path / "cache", progress=False)
    (tmp_path / "file").write_text("a file where the cache folder should be")
    np.testing.assert_array_equal(compute_targets(model, stream, fingerprint, cache_dir=tmp_path / "file",
                                                  progress=False), expected)
    assert capsys.readouterr().err.startswith("warning: the targets are not cached: ")


def test_cache_dir_defaults_to_fastens_cache(monkeypatch, tmp_path, model_and_fingerprint):
    model, fingerprint = model_and_fingerprint
    monkeypatch.setenv("FASTENS_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "targets"
    compute_targets(model, generate_stream(2, 4, seed=0), fingerprint, progress=False)
    assert len(list((tmp_path / "targets").glob("*.npy"))) == 1


def test_stored_targets_are_used_only_with_their_weights(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    base = generate_stream(2, 6, seed=0)
    stored = np.full((6, 4), 0.5, dtype=np.float32)
    stream = Stream(base.symbols, base.features, base.delay_ms, stored,
                    {"weights_fingerprint": fingerprint, "model_code_version": model_code_version(),
                     "targets_fingerprint": targets_fingerprint(stored)})
    counting = CountingModel(model)
    np.testing.assert_array_equal(compute_targets(counting, stream, fingerprint, cache_dir=tmp_path,
                                                  progress=False), stored)
    assert counting.steps == 0
    other = compute_targets(counting, stream, "other-weights", cache_dir=tmp_path, progress=False)
    assert counting.steps > 0 and not np.array_equal(other, stored)


def test_stored_targets_edited_after_they_were_made_are_not_the_models(model_and_fingerprint, tmp_path):
    """A make_stream file's targets changed since (its meta kept) were scored as the model's, and said to match it."""
    model, fingerprint = model_and_fingerprint
    base = generate_stream(2, 6, seed=0)
    made = np.full((6, 4), 0.5, dtype=np.float32)
    meta = {"weights_fingerprint": fingerprint, "model_code_version": model_code_version(),
            "targets_fingerprint": targets_fingerprint(made)}
    stream = Stream(base.symbols, base.features, base.delay_ms, made + 0.01, meta)
    counting = CountingModel(model)
    targets = compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    assert counting.steps > 0 and not np.array_equal(targets, stream.targets)


@pytest.mark.parametrize("meta", [{"model_code_version": "an older client/model/"}, {}],
                         ids=["older model code", "model code not said"])
def test_stored_targets_of_other_model_code_are_recomputed(meta, model_and_fingerprint, tmp_path):
    """A stream file whose targets the same weights made under other model code (or one that does not say which
    code) is scored against the model's targets of this code, as the cache's are, not its own."""
    model, fingerprint = model_and_fingerprint
    base = generate_stream(2, 6, seed=0)
    stored = np.full((6, 4), 0.5, dtype=np.float32)
    stream = Stream(base.symbols, base.features, base.delay_ms, stored, {"weights_fingerprint": fingerprint, **meta})
    counting = CountingModel(model)
    targets = compute_targets(counting, stream, fingerprint, cache_dir=tmp_path, progress=False)
    assert counting.steps > 0 and not np.array_equal(targets, stored)


def test_progress_bar_reports_steps(model_and_fingerprint, tmp_path, capsys):
    model, fingerprint = model_and_fingerprint
    stream = generate_stream(2, 10, seed=5)
    steps = max(np.unique(stream.symbols, return_counts=True)[1])
    compute_targets(model, stream, fingerprint, cache_dir=tmp_path / "a", progress=True)
    err = capsys.readouterr().err
    assert f"{steps}/{steps} steps" in err and "steps/s" in err
    assert "\r" not in err  # stderr is no terminal here: lines, as a log wants them
    compute_targets(model, stream, fingerprint, cache_dir=tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""


def test_non_finite_predictions_are_an_error_naming_the_row(model_and_fingerprint, tmp_path):
    stream = generate_stream(1, 6, seed=0)
    with pytest.raises(ValueError, match="NaN or inf prediction at request row 3 .symbol SYM_000"):
        compute_targets(NaNAfterThreeSteps(model_and_fingerprint[0]), stream, "w", cache_dir=tmp_path,
                        progress=False)
    assert not list(tmp_path.glob("*.npy"))


def test_targets_are_computed_with_fp32_products_whatever_the_process_set(model_and_fingerprint, tmp_path,
                                                                          monkeypatch):
    # a team module that turns TF32 on at import (the evaluator imports it before the targets) made the full
    # preset's RetNet targets 93% within atol of the fp32 model's, cached as its
    seen = []

    class FlagRecordingModel(CountingModel):
        def forward(self, features, state):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            return super().forward(features, state)

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    compute_targets(FlagRecordingModel(model_and_fingerprint[0]), generate_stream(2, 6, seed=0), "w",
                    device="cpu", cache_dir=tmp_path, progress=False)
    assert seen and not any(seen)
    assert torch.backends.cuda.matmul.allow_tf32  # the process's own setting comes back


@pytest.mark.parametrize("stream, fingerprint, error, message", [
    (generate_stream(1, 2, seed=0), "", ValueError, "weights_fingerprint must be a non-empty string"),
    (generate_stream(1, 2, seed=0), None, ValueError, "weights_fingerprint must be a non-empty string"),
    (np.zeros((2, 79), np.float32), "w", TypeError, "stream must be a client.streams.Stream"),
])
def test_bad_arguments_are_rejected(stream, fingerprint, error, message, model_and_fingerprint, tmp_path):
    with pytest.raises(error, match=message):
        compute_targets(model_and_fingerprint[0], stream, fingerprint, cache_dir=tmp_path, progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_targets_match_cpu(model_and_fingerprint, tmp_path):
    model, fingerprint = model_and_fingerprint
    stream = uneven_stream()
    cpu = compute_targets(model, stream, fingerprint, device="cpu", cache_dir=tmp_path / "cpu", progress=False)
    gpu = compute_targets(model, stream, fingerprint, device=None, cache_dir=tmp_path / "gpu", progress=False)
    model.to("cpu")
    np.testing.assert_allclose(gpu, cpu, rtol=1e-3, atol=1e-4)


def test_make_stream_stores_targets_with_their_weights(model_and_fingerprint, tmp_path):
    import importlib.util
    from pathlib import Path
    from client.streams import load_stream
    path = Path(__file__).resolve().parent.parent / "scripts" / "make_stream.py"
    spec = importlib.util.spec_from_file_location("make_stream", path)
    make_stream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_stream)
    model, fingerprint = model_and_fingerprint
    out = tmp_path / "stream.npz"
    make_stream.main(["--preset", "tiny", "--weights-seed", "0", "--symbols", "3", "--requests", "15", "--seed", "2",
                      "--targets", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    stream = load_stream(out)
    assert stream.meta["weights_fingerprint"] == fingerprint and stream.meta["preset"] == "tiny"
    assert stream.meta["model_code_version"] == model_code_version()
    assert stream.meta["targets_fingerprint"] == targets_fingerprint(stream.targets)
    np.testing.assert_allclose(stream.targets, run_each_symbol_alone(model, stream), rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit, match="make_stream: .*missing.pt"):
        make_stream.main(["--preset", "tiny", "--weights", str(tmp_path / "missing.pt"), "--symbols", "3",
                          "--requests", "15", "--seed", "2", "--targets", "--out", str(out)])
