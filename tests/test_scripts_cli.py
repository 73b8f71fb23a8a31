"""The scripts (make_weights.py, make_stream.py, long_stream.py, the benchmarks' command lines) as a user runs them:
progress, one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client.engine.precision import Precision
from client.model import load_model
from conftest import run_side_by_side

REPO = Path(__file__).resolve().parent.parent


def run(script, *args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_make_weights_reports_generating_saving_and_fingerprinting(tmp_path):
    out = tmp_path / "w" / "tiny-4.pt"
    done = run("make_weights.py", "--preset", "tiny", "--seed", "4", "--out", out)
    assert done.returncode == 0, done.stderr
    generating, saving, fingerprinting = done.stderr.strip().splitlines()
    assert generating.startswith("generating tensors: 196/196 (100%)")
    assert saving.startswith(f"saving {out}: ") and " (100%)" in saving
    assert fingerprinting == "fingerprinting ..."
    fingerprint = load_model("tiny", seed=4)[1]
    assert f"fingerprint {fingerprint}" in done.stdout
    assert load_model("tiny", weights=str(out))[1] == fingerprint  # saved through the counting writer: the same
    assert not out.with_suffix(".pt.tmp").exists()


def test_make_weights_leaves_no_partial_file_when_saving_fails(tmp_path, monkeypatch):
    from scripts import make_weights

    def save_half(state, writer):
        writer.write(b"x" * 1000)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(make_weights.torch, "save", save_half)
    out = tmp_path / "w.pt"
    with pytest.raises(OSError, match="No space left"):
        make_weights.save({"w": torch.zeros(4)}, out)
    assert list(tmp_path.iterdir()) == []


def test_script_mistakes_are_one_line(tmp_path):
    cases = [
        ("make_weights.py", ["--preset", "huge", "--out", tmp_path / "w.pt"],
         "scripts/make_weights.py: error: argument --preset: invalid choice: 'huge'"),
        ("make_stream.py", ["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "tiny",
                            "--weights", tmp_path / "missing.pt", "--out", tmp_path / "s.npz"],
         f"make_stream: weights file not found: {tmp_path / 'missing.pt'}"),
        ("make_weights.py", ["--preset", "tiny", "--out", tmp_path],
         f"scripts/make_weights.py: error: --out {tmp_path} is a folder; give a file path"),
        # a missing folder's name: the weights went into a file of that name
        ("make_weights.py", ["--preset", "tiny", "--out", f"{tmp_path / 'weights'}/"],
         f"scripts/make_weights.py: error: --out {tmp_path / 'weights'}/ names a folder; give a file path"),
        ("make_stream.py", ["--symbols", "2", "--requests", "5", "--seed", "1", "--out", f"{tmp_path / 's.npz'}/"],
         f"make_stream: error: --out {tmp_path / 's.npz'}/ names a folder; give a file path"),
        # read_checkpoint would read it as safetensors, and fail
        ("make_weights.py", ["--preset", "tiny", "--out", tmp_path / "w.safetensors"],
         f"scripts/make_weights.py: error: --out {tmp_path / 'w.safetensors'}: this writes torch's format; name the "
         f"file .pt"),
        ("make_weights.py", ["--preset", "tiny", "--out", tmp_path / "a_file" / "w.pt"],
         f"scripts/make_weights.py: error: --out {tmp_path / 'a_file' / 'w.pt'}: {tmp_path / 'a_file'} is a file, "
         f"not a folder"),
        ("make_weights.py", ["--preset", "tiny", "--seed", "-1", "--out", tmp_path / "w.pt"],
         "scripts/make_weights.py: error: argument --seed: must be a non-negative integer, got '-1'"),
        ("make_stream.py", ["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "tiny",
                            "--device", "bogus", "--out", tmp_path / "s.npz"],
         "make_stream: error: --device bogus: not a torch device"),
        ("host_hiccups.py", ["--seconds", "0"], "scripts/host_hiccups.py: error: argument --seconds: "),
        ("loop_costs.py", ["--step-rows", "64,0"],
         "scripts/loop_costs.py: error: argument --step-rows: must be a positive integer, got '0'"),
        ("kernel_times.py", ["--batches", "64x4,8x0"],
         "scripts/kernel_times.py: error: argument --batches: a step shape is B or GxK with positive integers, got "
         "'8x0'"),
        ("matmul_error.py", ["--rows", "64,0"],
         "scripts/matmul_error.py: error: argument --rows: must be a positive integer, got '0'"),
        ("long_stream.py", ["--steps", "0"], "scripts/long_stream.py: error: argument --steps: must be a positive "
                                             "integer, got '0'"),
        ("long_stream.py", ["--seed", "-1"], "scripts/long_stream.py: error: argument --seed: must be a non-negative"),
        # refused before the run, not after it
        ("long_stream.py", ["--json", tmp_path / "nowhere" / "r.json"],
         f"scripts/long_stream.py: error: argument --json: no such folder: {tmp_path / 'nowhere'}"),
        *((script, [*args, "--json", tmp_path / "nowhere" / "r.json"],
           f"{prog}: error: argument --json: no such folder: {tmp_path / 'nowhere'}")
          for script, prog, args in [("shard_hop.py", "scripts/shard_hop.py", []),
                                     ("host_hiccups.py", "scripts/host_hiccups.py", []),
                                     ("engine_starts.py", "scripts/engine_starts.py", ["--device", "cpu"]),
                                     ("compile_bench.py", "scripts/compile_bench.py", ["--device", "cpu"]),
                                     ("precision_cost.py", "precision_cost.py", ["auto", "--device", "cpu"])]),
    ]
    (tmp_path / "a_file").write_text("")
    runs = run_side_by_side([[sys.executable, str(REPO / "scripts" / script), *map(str, args)]
                             for script, args, _ in cases], cwd=REPO)
    for (code, stderr), (script, _, message) in zip(runs, cases):
        assert code == 2, (script, stderr)
        assert "Traceback" not in stderr
        assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith(message)


@pytest.mark.parametrize("module, entry, argv, message", [
    # each went on: a seed refused later in numpy's words, naming no option (compile_bench's child a second error)
    ("compile_bench", "parse_args", ["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    ("forming_ab", "parse_args", ["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    ("shard_hop", "main", ["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    ("profile_step", "main", ["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    ("compile_bench", "parse_args", ["--iters", "0"], "argument --iters: must be a positive integer"),  # IndexError
    ("engine_starts", "main", ["--timeout", "-1"], "argument --timeout: must be a positive number"),  # all failed
])
def test_numbers_out_of_range_are_refused_at_parse(module, entry, argv, message, usage_error, monkeypatch):
    import importlib

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # shard_hop sets it on import
    assert message in usage_error(getattr(importlib.import_module(f"scripts.{module}"), entry), argv)


def test_an_output_folder_that_takes_no_file_is_refused_before_the_work(usage_error):
    """Found when saving: after the full preset's minutes of generation, or the targets. /proc takes no new file,
    for root too (whom os.access lets write anywhere)."""
    from scripts import make_stream, make_weights

    assert "--out /proc/w.pt: cannot write in /proc: " in usage_error(make_weights.main,
                                                                      ["--preset", "tiny", "--out", "/proc/w.pt"])
    argv = ["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "tiny", "--out", "/proc/s.npz"]
    assert "--out /proc/s.npz: cannot write in /proc: " in usage_error(make_stream.parse_args, argv)


def test_make_stream_refuses_an_out_that_is_a_folder_or_under_a_file_before_the_work(tmp_path, usage_error):
    """As make_weights does: a folder named s.npz was taken, and failed when saving, after the targets; a folder
    that is a file read as 'cannot write in it: File exists'."""
    from scripts import make_stream

    (tmp_path / "s.npz").mkdir()
    (tmp_path / "taken").write_text("")
    argv = ["--symbols", "2", "--requests", "5", "--seed", "1", "--out"]
    assert f"--out {tmp_path / 's.npz'} is a folder; give a file path" in usage_error(
        make_stream.parse_args, [*argv, str(tmp_path / "s.npz")])
    assert f"--out {tmp_path / 'taken' / 's.npz'}: {tmp_path / 'taken'} is a file, not a folder" in usage_error(
        make_stream.parse_args, [*argv, str(tmp_path / "taken" / "s.npz")])


def test_long_stream_of_one_step_writes_valid_json_with_its_progress(tmp_path):
    out = tmp_path / "with space" / "long.json"
    out.parent.mkdir()
    done = run("long_stream.py", "--preset", "tiny", "--steps", "1", "--device", "cpu", "--json", out)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("steps: 1/1 (100%)")
    report = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert report["finite"] and report["steps"] == 1
    for tower in report["towers"].values():  # one step has no spread: null, not NaN
        assert tower["std"] is None and tower["std_last_1000"] is None and tower["max_abs"] > 0
    assert json.loads(done.stdout) == report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_long_stream_on_cuda_without_cuda_is_one_line():
    done = run("long_stream.py", "--device", "cuda", "--steps", "2")
    assert done.returncode == 2 and done.stderr.startswith("scripts/long_stream.py: error: --device cuda, but this ")
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_benchmarks_on_a_machine_without_cuda_are_one_line():
    # each ran until a child's traceback, or failed every start alike
    cases = [("compile_bench.py", "scripts/compile_bench.py: error: --device cuda, but this torch"),
             ("engine_starts.py", "scripts/engine_starts.py: error: --device cuda, but this torch"),
             ("bench_matmul.py", "scripts/bench_matmul.py: error: needs a CUDA GPU")]
    runs = run_side_by_side([[sys.executable, str(REPO / "scripts" / script)] for script, _ in cases], cwd=REPO)
    for (code, stderr), (script, message) in zip(runs, cases):
        assert code == 2 and stderr.startswith(message), (script, stderr)
        assert stderr.strip().splitlines() == [stderr.strip()]


def test_make_stream_to_parquet_without_pyarrow_is_refused_before_the_targets(monkeypatch, usage_error, tmp_path):
    from scripts.make_stream import parse_args
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what `import pyarrow` sees where it is not installed
    argv = ["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "tiny",
            "--out", str(tmp_path / "s.parquet")]
    assert "parquet needs the optional package pyarrow: pip install pyarrow" in usage_error(parse_args, argv)


def test_make_stream_as_a_console_script_names_itself_in_every_error(tmp_path):
    entry_point = ("import sys; sys.argv[0] = '/venv/bin/fastens-make-stream'; "
                   "from scripts.make_stream import run; sys.exit(run())")
    done = subprocess.run([sys.executable, "-c", entry_point, "--symbols", "2", "--requests", "5", "--seed", "1",
                           "--targets", "--preset", "tiny", "--weights", tmp_path / "missing.pt"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("fastens-make-stream: weights file not found"), done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("script, args", [("profile_step.py", ["--preset", "tiny"]),
                                          ("kernel_times.py", ["--batches", "64x1,64x4"]),
                                          ("pin_probe.py", ["--slots", "4"]),
                                          ("matmul_error.py", ["--rows", "64"])])
def test_gpu_scripts_without_cuda_say_what_they_need_in_one_line(script, args):
    done = run(script, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"scripts/{script}: error: needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_tile_sweep_says_what_it_needs_as_the_other_tools_do(monkeypatch, cli_here, usage_error):
    """It printed a line of its own, with no tool name, and took --json unchecked: a missing folder failed after
    the first shape's timing."""
    from kernels import _common
    from scripts import tile_sweep

    monkeypatch.setattr(_common, "INTERPRET", False)
    code, stderr = cli_here(tile_sweep.main, "scripts/tile_sweep.py", ["--ops", "mamba2"])
    assert code == 2 and stderr.startswith("scripts/tile_sweep.py: error: needs a CUDA GPU (it times Triton kernels)")
    assert "argument --json: no such folder: /nowhere" in usage_error(tile_sweep.main, ["--json", "/nowhere/t.json"])


def test_host_hiccups_spins_once_on_every_cpu_it_may_use(tmp_path):
    out = tmp_path / "hiccups.json"
    done = run("host_hiccups.py", "--seconds", "0.3", "--gap-ms", "0.5", "--json", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    cpus = sorted(os.sched_getaffinity(0))
    assert [int(cpu) for cpu in result["cpus"]] == cpus
    for row in result["cpus"].values():
        assert row["gaps"] >= 0 and row["longest_ms"] > 0 and row["gap_ms_total"] >= 0.5 * row["gaps"]
        assert row["steal_ms"] is None or row["steal_ms"] >= 0
    assert f"{len(cpus)} CPUs over 0.3 s:" in done.stdout and "the hypervisor's steal" in done.stdout


def test_loop_costs_times_the_runtimes_receive_and_answer_paths_per_request(tmp_path):
    """What the client's event loop spends a request on its own paths and on the link beneath them (a loopback
    websocket from a server process; bench/LOG.md section 78) and on the server's scores of its answers, written
    as asked; a frame of one request costs more a
    request than a frame of many (its framing, decode and checks are the frame's)."""
    out = tmp_path / "costs.json"
    done = run("loop_costs.py", "--frame-requests", "1,20", "--step-rows", "1,50", "--requests", "400", "--reps", "1",
               "--json", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    receive, wire, answer, score = (result[f"{path}_us_per_request"] for path in ("receive", "wire", "answer", "score"))
    assert set(receive) == set(wire) == {"1", "20"} and set(answer) == set(score) == {"1", "50"}
    assert all(us > 0 for us in (*receive.values(), *wire.values(), *answer.values(), *score.values()))
    assert receive["1"] > receive["20"] and wire["1"] > wire["20"]
    assert "receive,   20 requests a frame:" in done.stdout and "link,      20 requests a frame:" in done.stdout
    assert "answer,    50 requests a step:" in done.stdout and "score,     50 requests a step:" in done.stdout


def test_loop_costs_without_websockets_says_the_link_is_not_measured(monkeypatch, capsys, tmp_path):
    """The GPU machine's image has no websockets: the link is said not measured in one line, the rest measured."""
    import importlib.util

    from scripts import loop_costs

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "websockets" else
                        find_spec(name, *a))
    out = tmp_path / "costs.json"
    assert loop_costs.main(["--frame-requests", "4", "--step-rows", "8", "--requests", "80", "--reps", "1",
                            "--json", str(out)]) == 0
    assert "link: not measured (websockets is not installed: pip install websockets)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["wire_us_per_request"] == {} and result["receive_us_per_request"]["4"] > 0


@pytest.mark.parametrize("args", [["-m", "client.model", "--manifest"],
                                  ["scripts/host_hiccups.py", "--seconds", "0.05"],
                                  # a smoke run in Triton's interpreter, timing nothing (no tiling matches)
                                  ["-m", "scripts.tile_sweep", "--preset", "tiny", "--shapes", "1x1", "--ops", "mamba2",
                                   "--reps", "1", "--match", "no tiling"]])
def test_a_tool_whose_reader_leaves_ends_quietly(args):
    """`python -m client.model --manifest | head` ended in a BrokenPipeError traceback; these ran without run_cli."""
    from test_cli import run_for_a_reader_that_left

    if "scripts.tile_sweep" in args:
        pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    assert run_for_a_reader_that_left(*args, env=env) == (141, "")


def test_host_hiccups_reads_each_cpus_steal_from_proc_stat(monkeypatch, tmp_path):
    import builtins

    from scripts import host_hiccups
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100 0 0 0 9 0 0\ncpu0 4 0 2 50 0 0 0 7 0 0\ncpu1 6 0 3 50 0 0 0 2 0 0\nintr 5\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open",
                        lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k))
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    assert host_hiccups.steal_ms() == {0: 7 * tick_ms, 1: 2 * tick_ms}  # the aggregate "cpu" line is no CPU
    stat.unlink()
    assert host_hiccups.steal_ms() == {}


def test_host_hiccups_counts_the_gaps_that_half_the_other_cpus_share():
    from scripts.host_hiccups import shared_gaps
    assert shared_gaps({0: [(0, 10)], 1: [(5, 15)], 2: [(100, 110)]}) == 2  # 0 and 1 overlap; 2 stopped alone
    assert shared_gaps({0: [(0, 10)], 1: [(10, 20)], 2: [(30, 40)]}) == 0   # touching is not overlapping
    assert shared_gaps({0: [(0, 10), (20, 30)]}) == 0                     # one CPU shares with no one


def test_matmul_error_measures_each_rows_error_against_its_largest_exact_value():
    from scripts.matmul_error import errors

    exact = torch.tensor([[2.0, -4.0, 1.0], [1e-3, 0.0, 0.0]], dtype=torch.float64)
    y = (exact + torch.tensor([[0.0, 0.004, 0.0], [0.0, 0.0, 1e-6]], dtype=torch.float64)).float()
    largest, mean = errors(y, exact, rows=3)
    assert largest == pytest.approx(1e-3, rel=1e-3)  # row 0: 0.004 / 4; row 1: 1e-6 / 1e-3
    assert mean == pytest.approx(2e-3 / 6, rel=1e-2)
    assert errors(y, exact, rows=1) == pytest.approx((0.0, 0.0), abs=1e-7)  # only the first column: exact in fp32


@pytest.mark.parametrize("args, message", [
    (["--batches", "1,0"], "argument --batches: must be a positive integer, got '0'"),
    (["--batches", "20,100"], "argument --batches: batch sizes go up to 64, got '20,100'"),
    (["--variant", "retnet.mlp=float17"], "argument --variant: 'retnet.mlp=float17': unknown precision 'float17'"),
    (["--variant", "skinny=float33"], "argument --variant: 'skinny=float33': skinny= takes torch dtypes"),
    (["--priorities", "xlstm=high"], "argument --priorities: 'xlstm=high': expected none or tower=priority"),
    (["--priorities", "lstm=-1"], "argument --priorities: 'lstm=-1': expected none or tower=priority"),
])
def test_profile_step_refuses_a_bad_option_before_any_timing(args, message, usage_error):
    """Each was found only when reached, minutes into a run on a GPU (a variant's after all the timing)."""
    from scripts.profile_step import main
    assert usage_error(main, ["--preset", "tiny", *args]).startswith(f"scripts/profile_step.py: error: {message}")


def test_profile_step_parses_its_variants_and_priorities():
    from scripts.profile_step import priorities_argument, variant_argument
    assert priorities_argument("none") == ("none", {})
    assert priorities_argument("xlstm=-1,mamba2=-1") == ("xlstm=-1,mamba2=-1", {"xlstm": -1, "mamba2": -1})
    spec, precision, skinny = variant_argument("retnet.mlp=float16,skinny=float32+float16")
    assert spec == "retnet.mlp=float16,skinny=float32+float16" and skinny == [torch.float32, torch.float16]
    assert precision.spec == Precision.parse("auto,retnet.mlp=float16").spec
    assert variant_argument("skinny=none")[2] == [] and variant_argument("hawk=bf16")[2] is None


def test_profile_step_tells_towers_that_ran_behind_another_towers_chain():
    """profile_step's tower timeline: profiled replays split at their idle gaps, each tower's state kernels' first
    and last from the replay's start, and the towers that started only after another tower's chain ended."""
    from scripts.profile_step import TOWER_KERNELS, tower_spans

    def chain(tower, start, blocks, every=80.0):  # a tower's state kernel once a block, 10 us each
        return [(TOWER_KERNELS[tower] + " ", start + i * every, start + i * every + 10.0) for i in range(blocks)]
    side_by_side = [("input_up", 0.0, 5.0)] + [k for i, t in enumerate(TOWER_KERNELS) for k in chain(t, 20 + i, 12)]
    behind = ([("input_up", 50000.0, 50005.0)] + chain("xlstm", 50020, 12) + chain("mamba2", 50030, 12)
              + chain("retnet", 51000, 12) + chain("hawk", 51010, 12))
    first, second = tower_spans(side_by_side + behind)
    assert first["late"] == [] and first["towers"]["mamba2"] == (21.0, 21.0 + 11 * 80 + 10)
    assert second["late"] == ["hawk", "retnet"]  # both started after Mamba2's last state kernel ended
    assert second["span_us"] == 51010 + 11 * 80 + 10 - 50000
