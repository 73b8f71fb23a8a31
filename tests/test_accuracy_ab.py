"""scripts/accuracy_ab.py: precision specs against the fp32 and the fp64 reference (a CPU run on the tiny preset)."""
import json
import subprocess
import sys
from pathlib import Path

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
