import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from client.engine.reference import ReferenceEngine
from client.model import load_model
from team.example_model import ExampleModel, parse_args

REPO = Path(__file__).resolve().parent.parent


def test_process_batch_maps_ids_to_predictions_in_symbol_order():
    model = load_model("tiny", seed=2)[0]
    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, 79)).astype(np.float32)
    out = ExampleModel(ReferenceEngine(model)).process_batch({"B": (7, features[0]), "A": (3, features[1])})
    assert out["unique_ids"] == [7, 3]
    np.testing.assert_array_equal(out["predictions"], ReferenceEngine(model).step(["B", "A"], features))
    empty = ExampleModel(ReferenceEngine(model)).process_batch({})
    assert empty["unique_ids"] == [] and empty["predictions"].shape == (0, 4)


@pytest.mark.parametrize("argv, match", [
    (["--host", "127.0.0.1"], "--host needs --port"),
    (["--port", "9000"], "--port without --host"),
    (["--symbols", "0"], "must be positive"),
    (["--rate", "-5"], "--rate must be positive"),
    (["--engine", "slow"], "invalid choice"),
    (["--preset", "huge"], "invalid choice"),
])
def test_bad_options_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert match in capsys.readouterr().err


def test_preset_default_is_announced(capsys):
    args = parse_args([])
    assert args.preset in ("full", "tiny")
    assert f"--preset not given: using {args.preset}" in capsys.readouterr().err


def test_embedded_server_plays_to_the_end(tmp_path):
    out = tmp_path / "e.json"
    result = subprocess.run([sys.executable, str(REPO / "team" / "example_model.py"), "--preset", "tiny",
                             "--symbols", "6", "--requests", "300", "--json", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["requests"] == 300 and summary["responses"] == 300 and summary["missed"] == 0
    assert summary["accuracy"] == 1.0
    assert set(summary["latency_ms"]) >= {"p50", "p90", "p99", "mean", "max"}
    assert summary["responses_per_s"] > 0 and summary["pnl"] > 0
