"""scripts/accuracy_ab.py: precision specs against the fp32 and the fp64 reference (a CPU run on the tiny preset)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accuracy_ab.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_an_fp64_input_path_is_closer_to_the_fp64_reference(tmp_path):
    out = tmp_path / "ab.json"
    done = run("auto;auto,retnet.input_down=fp32", "--preset", "tiny", "--device", "cpu", "--families", "feed_mix",
               "--steps", "20", "--seeds", "0", "--per-symbol", "3", "--json", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["per_symbol"] == 3 and set(result["engines"]) == {"auto", "auto,retnet.input_down=fp32"}
    assert "fp32 reference vs fp64" in done.stdout and "auto,retnet.input_down=fp32" in done.stdout
    # a feed of prices and volumes: the fp32 reference's own RetNet error is what the fp64 input path leaves out
    exact, fp32 = (result["engines"][spec]["fp64"]["feed_mix"]["retnet"] for spec in result["engines"])
    assert exact["mean_abs_err"] < 0.7 * fp32["mean_abs_err"]
    assert result["fp32_reference_vs_fp64"]["retnet"]["mean_abs_err"] > exact["mean_abs_err"]


def test_an_unknown_family_is_a_one_line_error():
    done = run("auto", "--preset", "tiny", "--device", "cpu", "--families", "feed_mix,nope")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown families ['nope']" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0,x"], "argument --seeds: must be a non-negative integer, got 'x'"),
    (["--seeds", ","], "argument --seeds: needs at least one seed, got ','"),
    (["--seeds", "-1"], "argument --seeds: must be a non-negative integer, got '-1'"),
    (["--json", "/nonexistent-folder/ab.json"], "argument --json: no such folder: /nonexistent-folder"),
])
def test_bad_options_are_one_line_before_the_run(args, message):
    done = run("auto", "--preset", "tiny", "--device", "cpu", "--steps", "2", *args)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"scripts/accuracy_ab.py: error: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_default_cuda_device_without_cuda_is_one_line():
    done = run("auto", "--preset", "tiny", "--steps", "2")
    assert done.returncode == 2 and done.stderr.startswith("scripts/accuracy_ab.py: error: --device cuda, but ")
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]


def test_promoted_partials_run_beside_each_spec(tmp_path):
    """--promote-partials both: each spec's engine built twice, with the skinny kernel's setting off, then on (the
    default)."""
    out = tmp_path / "ab.json"
    done = run("auto", "--preset", "tiny", "--device", "cpu", "--families", "normal", "--steps", "5", "--seeds", "0",
               "--no-fp64", "--promote-partials", "both", "--json", out)
    assert done.returncode == 0, done.stderr
    engines = json.loads(out.read_text())["engines"]
    assert set(engines) == {"auto", "auto+unpromoted"} and "auto+unpromoted" in done.stdout
    assert set(engines["auto+unpromoted"]["fp32"]["normal"]) == {"xlstm", "mamba2", "retnet", "hawk"}


def test_the_promote_setting_is_each_engines_and_restored_after():
    import importlib

    from scripts.accuracy_ab import measure
    from scripts.precision_cost import specs_argument

    skinny = importlib.import_module("kernels.skinny_matmul")
    seen = []
    measure(specs_argument("auto"), ["normal"], "tiny", "cpu", seeds=[0], symbols=1, steps=3, fp64=False,
            progress=lambda message: seen.append((message, skinny.PROMOTE_PARTIALS)), promotes=(False, True))
    assert [(m, on) for m, on in seen if m.endswith("measured")] == [("auto+unpromoted: measured", False),
                                                                      ("auto: measured", True)]
    assert skinny.PROMOTE_PARTIALS is True


def test_a_tower_with_no_finite_prediction_is_null_in_the_json(tmp_path, monkeypatch):
    """A spec whose engine gave NaN for every prediction of a tower wrote NaN into --json, which strict JSON
    readers (jq, JavaScript) refuse."""
    import math

    from scripts import accuracy_ab
    from client.accuracy import tower_errors

    errors = tower_errors(np.full((4, 4), np.nan), np.zeros((4, 4)))
    assert math.isnan(errors["xlstm"]["max_abs_err"])
    monkeypatch.setattr(accuracy_ab, "measure", lambda *args: {"engines": {"fp16": {"fp32": {"normal": errors}}}})
    out = tmp_path / "ab.json"
    accuracy_ab.main(["fp16", "--preset", "tiny", "--device", "cpu", "--json", str(out)])
    row = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert row["engines"]["fp16"]["fp32"]["normal"]["xlstm"] == {**errors["xlstm"], "within_atol": 0.0,
                                                                "max_abs_err": None, "mean_abs_err": None,
                                                                "rmse": None}


def test_the_table_never_shows_a_share_with_misses_as_all_within():
    from scripts.accuracy_ab import table
    from client.accuracy import tower_errors

    predictions = np.zeros((100_000, 4))
    predictions[:2, 0] = 1.0  # 2 misses in 100,000: 99.998% read 100.00%
    line = table({"engines": {"fp16": {"fp32": {"normal": tower_errors(predictions, np.zeros((100_000, 4)))}}}})
    assert "xlstm  99.99% max" in line and "mamba2 100.00% max" in line
