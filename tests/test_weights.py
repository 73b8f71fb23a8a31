"""Deterministic weights, fingerprints and strict checkpoint loading."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client.model import get_preset, load_model, manifest
from client.weights import CheckpointMismatch, fingerprint, make_weights, read_checkpoint

REPO = Path(__file__).resolve().parents[1]
# Pinned: the generator must give these bytes on every machine and library version.
TINY_SEED0_FINGERPRINT = "e026bed994444dae"


def test_two_generations_are_identical_and_seeds_differ():
    a, b = make_weights(get_preset("tiny"), 7), make_weights(get_preset("tiny"), 7)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = make_weights(get_preset("tiny"), 8)
    assert not torch.equal(a["towers.0.input_up.weight"], c["towers.0.input_up.weight"])
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


def test_fingerprint_is_pinned_and_sees_every_byte():
    assert fingerprint(make_weights(get_preset("tiny"), 0)) == TINY_SEED0_FINGERPRINT
    state = make_weights(get_preset("tiny"), 0)
    state["output_proj.weight"][0, 0] += 1e-3
    assert fingerprint(state) != TINY_SEED0_FINGERPRINT


def test_every_tensor_is_filled_with_finite_values():
    state = make_weights(get_preset("small"), 0)
    assert [(n, list(t.shape)) for n, t in state.items()] == [(m["name"], m["shape"]) for m in manifest("small")]
    for name, t in state.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
    retnet = "towers.2.blocks.0.layer."
    assert ((state[retnet + "decay"] > 0) & (state[retnet + "decay"] < 1)).all()
    hawk_a = state["towers.3.blocks.0.layer.rglru.a"] ** 8
    assert ((hawk_a >= 0.9 - 1e-6) & (hawk_a <= 0.999 + 1e-6)).all()
    assert (state["towers.1.blocks.0.layer.a"] < 0).all()


def test_checkpoint_round_trip(tmp_path):
    out = tmp_path / "w.pt"
    subprocess.run([sys.executable, "scripts/make_weights.py", "--preset", "tiny", "--seed", "4", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True)
    model, fp = load_model("tiny", weights=str(out))
    generated, fp_gen = load_model("tiny", seed=4)
    assert fp == fp_gen
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), generated.state_dict().values()))


def test_a_checkpoint_of_other_memory_layouts_gives_the_same_model(tmp_path):
    state = make_weights(get_preset("tiny"), 0)
    transposed = {k: v.t().contiguous().t() if v.ndim == 2 else v for k, v in state.items()}  # equal values
    torch.save(transposed, tmp_path / "t.pt")
    model, fp = load_model("tiny", weights=str(tmp_path / "t.pt"))
    seeded, fp_seeded = load_model("tiny", seed=0)
    assert fp == fp_seeded and all(p.is_contiguous() for p in model.state_dict().values())
    features = torch.randn(3, 79, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(features, model.init_state(3))[0], seeded(features, seeded.init_state(3))[0])


def test_mismatched_checkpoint_lists_offending_names(tmp_path):
    state = make_weights(get_preset("tiny"), 0)
    del state["towers.1.blocks.0.layer.a"]
    state["towers.9.extra"] = torch.zeros(1)
    state["output_proj.weight"] = torch.zeros(1, 32)
    state["towers.0.input_up.bias"] = state["towers.0.input_up.bias"].double()
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointMismatch) as err:
        load_model("tiny", weights=str(path))
    msg = str(err.value)
    assert "missing (1)" in msg and "towers.1.blocks.0.layer.a" in msg
    assert "unexpected (1)" in msg and "towers.9.extra" in msg
    assert "output_proj.weight: [1, 32]" in msg and "towers.0.input_up.bias" in msg and "float64" in msg


@pytest.mark.parametrize("change, cause", [
    (lambda state: make_weights(get_preset("small"), 0), "it holds the small preset's tensors (pass --preset small)"),
    (lambda state: {k: v.bfloat16() for k, v in state.items()}, "its tensors are bfloat16; the reference model loads "
                                                                 "float32 only"),
    (lambda state: {"module." + k: v for k, v in state.items()}, "every tensor name starts with 'module.'"),
])
def test_a_mismatch_says_its_file_and_cause_first(tmp_path, change, cause):
    # the CLIs show one line of about 260 characters: its start must say what is wrong, not a list of names
    path = tmp_path / "w.pt"
    torch.save(change(make_weights(get_preset("tiny"), 0)), path)
    with pytest.raises(CheckpointMismatch) as err:
        load_model("tiny", weights=str(path))
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"checkpoint {path} does not match the tiny preset's model: {cause}")
    assert len(first) - len(str(path)) < 200


def test_unreadable_and_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        read_checkpoint(tmp_path / "nope.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk.pt: not a torch.save file \(it starts with b'not a c"):
        read_checkpoint(junk)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        read_checkpoint(tmp_path / "list.pt")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_file_cut_short_is_a_clear_error(tmp_path, legacy):
    path = tmp_path / "w.pt"
    torch.save(make_weights(get_preset("tiny"), 0), path, _use_new_zipfile_serialization=not legacy)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cannot read checkpoint {path}: (the file ends early|unexpected EOF)"):
        read_checkpoint(path)


def test_a_training_checkpoint_gives_its_state_dict_or_a_clear_error(tmp_path):
    import argparse

    state = make_weights(get_preset("tiny"), 0)
    torch.save({"model": state, "step": 3}, tmp_path / "model.pt")
    assert fingerprint(read_checkpoint(tmp_path / "model.pt")) == TINY_SEED0_FINGERPRINT
    # torch's own message advises weights_only=False, which would run the file's code
    torch.save({"model": state, "args": argparse.Namespace(lr=1)}, tmp_path / "args.pt")
    with pytest.raises(ValueError, match=r"args.pt: it holds Python objects besides tensors, .*\(Unsupported global: "
                                         r"GLOBAL argparse.Namespace\): save the state dict alone"):
        read_checkpoint(tmp_path / "args.pt")


def test_a_checkpoint_in_torch_saves_older_format_is_read(tmp_path):
    state = make_weights(get_preset("tiny"), 0)
    path = tmp_path / "legacy.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert fingerprint(read_checkpoint(path)) == TINY_SEED0_FINGERPRINT


@pytest.mark.parametrize("entry, problem", [
    ({0: torch.zeros(1)}, "key 0 is not a tensor name"),
    ({"model": {"w": torch.zeros(1)}}, "model is a dict"),
    ({"w": torch.zeros(3).to_sparse()}, "tensor w is torch.sparse_coo"),
    ({"w": torch.empty(3, device="meta")}, "tensor w is meta"),
])
def test_a_state_dict_of_other_things_is_a_clear_error(tmp_path, entry, problem):
    path = tmp_path / "odd.pt"
    torch.save({**make_weights(get_preset("tiny"), 0), **entry}, path)
    with pytest.raises(ValueError, match=f"{path}.*{problem}"):
        load_model("tiny", weights=str(path))


def test_empty_folder_and_pickled_code_are_clear_errors(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.pt is empty"):
        read_checkpoint(tmp_path / "empty.pt")
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(ValueError, match="dir.pt is a folder"):
        read_checkpoint(tmp_path / "dir.pt")
    import pickle
    (tmp_path / "code.pt").write_bytes(pickle.dumps(print))  # weights_only refuses any callable
    with pytest.raises(ValueError, match="cannot read checkpoint .*code.pt"):
        read_checkpoint(tmp_path / "code.pt")


def test_a_broken_safetensors_file_is_a_clear_error(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    good = tmp_path / "w.safetensors"
    save_file(make_weights(get_preset("tiny"), 0), good)
    assert fingerprint(read_checkpoint(good)) == TINY_SEED0_FINGERPRINT
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(ValueError, match="cannot read checkpoint .*truncated.safetensors"):
        read_checkpoint(truncated)
    # a file of the other format: its name says how it is read
    (tmp_path / "st.pt").write_bytes(good.read_bytes())
    with pytest.raises(ValueError, match="st.pt: it looks like a safetensors file: name it .safetensors"):
        read_checkpoint(tmp_path / "st.pt")
    torch.save(make_weights(get_preset("tiny"), 0), tmp_path / "pt.safetensors")
    with pytest.raises(ValueError, match="pt.safetensors: it is a torch.save file: name it .pt"):
        read_checkpoint(tmp_path / "pt.safetensors")


@pytest.mark.parametrize("checkpoint", [
    lambda state: {"model": state, "step": torch.tensor(3), "loss": torch.tensor(0.25)},  # a tensor beside it
    lambda state: {"state_dict": state, "optimizer": {"state": {0: {"step": torch.tensor(3.0),
                                                                     "exp_avg": torch.zeros(2)}},
                                                       "param_groups": [{"lr": 1e-3, "params": [0]}]},
                   "global_step": torch.tensor(3)},
    # the layout of PyTorch's own tutorial ("Saving and loading a general checkpoint"): it was "epoch is a int"
    lambda state: {"epoch": 3, "model_state_dict": state, "optimizer_state_dict": {"state": {}, "param_groups": []},
                   "loss": torch.tensor(0.25)},
])
def test_a_training_checkpoint_with_tensors_beside_its_state_dict_is_read(tmp_path, checkpoint):
    path = tmp_path / "train.pt"
    torch.save(checkpoint(make_weights(get_preset("tiny"), 0)), path)
    assert fingerprint(read_checkpoint(path)) == TINY_SEED0_FINGERPRINT
    assert load_model("tiny", weights=str(path))[1] == TINY_SEED0_FINGERPRINT


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_checkpoint_saved_again_at_its_path_leaves_the_loaded_model_as_it_was(tmp_path, suffix):
    # a training script saving its next checkpoint over the one being played, or `cp` copying one over it (the same
    # file rewritten): the model must keep the weights its fingerprint names (the file's pages were mapped into the
    # model, and changed with the file; safetensors maps its files too)
    if suffix == ".safetensors":
        save = pytest.importorskip("safetensors.torch").save_file
    else:
        save = torch.save
    path, other = tmp_path / f"w{suffix}", tmp_path / f"other{suffix}"
    save(make_weights(get_preset("tiny"), 0), path)
    save(make_weights(get_preset("tiny"), 1), other)
    model, fp = load_model("tiny", weights=str(path))
    state = read_checkpoint(path)
    shutil.copyfile(other, path)
    assert fp == fingerprint(model.state_dict()) == fingerprint(state) == TINY_SEED0_FINGERPRINT
