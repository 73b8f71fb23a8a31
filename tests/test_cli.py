"""client/cli.py: what every command line shares."""
import errno
import io
import subprocess
import sys
from pathlib import Path

import pytest

from client import cli


def raising(exc):
    def main(argv):
        raise exc
    return main


@pytest.mark.parametrize("exc, code, line", [
    (cli.CliError("no stream at s.npz; make one with scripts/make_stream.py", cli.EXIT_REFUSED), 4,
     "tool: error: no stream at s.npz; make one with scripts/make_stream.py"),
    (ValueError("checkpoint does not match the model:\n  missing (2):\n    a\n    b"), 2,
     "tool: error: checkpoint does not match the model: missing (2): a b"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "w.pt"), 2,
     "tool: error: No such file or directory: w.pt"),
    (ImportError("--plot needs matplotlib: pip install matplotlib"), 2,
     "tool: error: --plot needs matplotlib: pip install matplotlib"),
    (RuntimeError("boom"), 1, "tool: unexpected error: RuntimeError: boom (rerun with --debug for the traceback)"),
    (KeyboardInterrupt(), 130, "tool: interrupted"),
])
def test_what_main_raises_becomes_one_line_and_an_exit_code(exc, code, line, capsys):
    assert cli.run_cli(raising(exc), "tool", []) == code
    assert capsys.readouterr().err == line + "\n"


def test_debug_prints_the_traceback_and_the_whole_message(capsys):
    long_message = "x" * (cli.MAX_MESSAGE_CHARS + 100) + "; do this"
    assert cli.run_cli(raising(ValueError(long_message)), "tool", []) == 2
    short = capsys.readouterr().err
    assert len(short) < cli.MAX_MESSAGE_CHARS + 60 and " [... --debug shows all of it ...] x" in short
    assert short.endswith("; do this\n")  # the end says what to do: kept
    assert cli.run_cli(raising(ValueError(long_message)), "tool", ["--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith(f"tool: error: {long_message}\n")


def test_sys_exit_with_a_message_is_an_ordinary_error(capsys):
    assert cli.run_cli(raising(SystemExit("make_stream: num_requests must be positive")), "tool", []) == 2
    assert capsys.readouterr().err == "make_stream: num_requests must be positive\n"
    with pytest.raises(SystemExit) as exit_info:  # a numeric exit (argparse's) passes through
        cli.run_cli(raising(SystemExit(2)), "tool", [])
    assert exit_info.value.code == 2


def test_every_session_outcome_has_an_exit_code():
    from client import runtime
    assert set(cli.EXIT_BY_OUTCOME) == set(runtime.OUTCOMES)
    assert cli.EXIT_BY_OUTCOME[runtime.COMPLETE] == 0
    # one code an outcome, but for giving up on a server that fails the same way on every connection and for a
    # server that began another stream: cut short too
    assert (cli.EXIT_BY_OUTCOME[runtime.GAVE_UP] == cli.EXIT_BY_OUTCOME[runtime.NEW_STREAM]
            == cli.EXIT_BY_OUTCOME[runtime.CUT_SHORT] == cli.EXIT_CUT_SHORT)
    others = [code for outcome, code in cli.EXIT_BY_OUTCOME.items() if outcome not in (runtime.GAVE_UP,
                                                                                          runtime.NEW_STREAM)]
    assert len(set(others)) == len(others)


def run_for_a_reader_that_left(*args, env=None):
    """Run a command whose stdout's reader has gone before it writes (`| head`): (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


def test_a_reader_of_the_output_that_leaves_ends_the_command_quietly():
    """`tool | head`: the output still buffered when main returns, or a write of main's own, finds the pipe closed:
    exit 141 with nothing on stderr (was "tool: error: Broken pipe", exit 2, or a BrokenPipeError traceback)."""
    for prints in ("print('x' * 100)", "print('x' * 1_000_000)"):
        code, err = run_for_a_reader_that_left(
            "-c", f"import sys; from client import cli; sys.exit(cli.run_cli(lambda argv: {prints}, 'tool'))")
        assert (code, err) == (cli.EXIT_OUTPUT_CLOSED, "")


def test_a_broken_pipe_not_of_the_output_is_an_ordinary_error(capsys):
    assert cli.run_cli(raising(BrokenPipeError(errno.EPIPE, "Broken pipe")), "tool", []) == 2
    assert capsys.readouterr().err == "tool: error: Broken pipe\n"


def test_main_returns_its_exit_code():
    assert cli.run_cli(lambda argv: None, "tool", []) == 0
    assert cli.run_cli(lambda argv: cli.EXIT_CUT_SHORT, "tool", []) == 6


def test_parser_reports_a_bad_option_in_one_line_and_has_debug(capsys):
    parser = cli.ArgumentParser(prog="tool")
    parser.add_argument("--count", type=int)
    assert parser.parse_args(["--debug"]).debug is True
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--count", "many"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "tool: error: argument --count: invalid int value: 'many' (see --help)\n"


def test_existing_file(tmp_path):
    (tmp_path / "w.pt").write_bytes(b"")
    assert cli.existing_file(str(tmp_path / "w.pt")) == str(tmp_path / "w.pt")
    with pytest.raises(Exception, match="no such file: .*nope.pt"):
        cli.existing_file(str(tmp_path / "nope.pt"))
    with pytest.raises(Exception, match="is a folder; give a file"):  # it said "no such file"
        cli.existing_file(str(tmp_path))


def test_an_output_file_named_as_a_folder_is_refused(tmp_path):
    """`--json out/` with no out/: the evaluator wrote a file `out` and the team client failed "Is a directory"
    after the whole play."""
    assert cli.output_file(str(tmp_path / "s.json")) == str(tmp_path / "s.json")
    with pytest.raises(Exception, match="is a folder; give a file path"):
        cli.output_file(str(tmp_path))
    with pytest.raises(Exception, match="out/ names a folder; give a file path"):
        cli.output_file(f"{tmp_path}/out/")


def test_seed():
    assert cli.seed("0") == 0 and cli.seed("7") == 7
    for text in ("-1", "x"):
        with pytest.raises(Exception, match=f"must be a non-negative integer, got '{text}'"):
            cli.seed(text)


def test_a_device_torch_does_not_know_is_an_ordinary_error():
    with pytest.raises(cli.CliError, match="--device bogus: not a torch device; use cpu, cuda or cuda:N"):
        cli.check_device("bogus")


def test_cuda_device_without_cuda_is_an_ordinary_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(cli.CliError, match="--device cuda, but this torch .* sees no CUDA GPU; use --device cpu"):
        cli.check_device("cuda")
    cli.check_device("cpu")
    cli.check_device(None)


def test_progress_writes_a_line_every_few_seconds_off_a_terminal(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    progress = cli.Progress(2000, "replay", unit=" requests", every_s=5.0, stream=out)
    for done, at in ((100, 101.0), (800, 106.0), (900, 107.0), (1600, 112.0)):
        now[0] = at
        progress.update(done)
    now[0] = 115.0
    progress.update(2000)
    progress.close()
    progress.close()  # once only
    assert out.getvalue().splitlines() == [
        "replay: 800/2,000 requests (40%), 6 s, ~9 s left",
        "replay: 1,600/2,000 requests (80%), 12 s, ~3 s left",
        "replay: 2,000/2,000 requests (100%), 15 s",
    ]


def test_progress_off_a_terminal_ends_with_its_last_line_once(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    progress = cli.Progress(300, "replay", unit=" requests", every_s=5.0, stream=out)
    now[0] = 106.0
    progress.update(300)  # the last update comes a line's interval after the previous one: written
    progress.close()
    assert out.getvalue().splitlines() == ["replay: 300/300 requests (100%), 6 s"]


def test_format_bytes():
    assert [cli.format_bytes(n) for n in (512, 1_500, 757_000_000, 7.9e9)] == ["512 B", "1.5 kB", "757.0 MB",
                                                                               "7.9 GB"]


def test_a_console_script_names_itself_in_its_messages(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fastens-team", "--port", "x"])
    assert cli.prog_name("team/example_model.py") == "fastens-team"
    monkeypatch.setattr(sys, "argv", ["team/example_model.py", "--port", "x"])
    assert cli.prog_name("team/example_model.py") == "team/example_model.py"
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert cli.prog_name("python -m server") == "python -m server"


def test_a_command_without_preset_runs_full_on_cuda_and_tiny_on_the_cpu(capsys):
    """The scripts that default to a preset take the full one only on a CUDA device: on the CPU its 8 GB of
    weights were killed for memory with no message (precision_cost.py on a 24 GB machine)."""
    from client.cli import preset_for
    from scripts import bench, forming_ab

    assert preset_for("small", "cpu") == "small" and capsys.readouterr().err == ""
    assert preset_for(None, "cuda:1") == "full" and preset_for(None, "cpu") == "tiny"
    assert "--preset not given: using tiny on cpu" in capsys.readouterr().err
    assert forming_ab.parse_args(["--device", "cpu"]).preset == "tiny"
    assert bench.parse_args(["--device", "cpu", "--quick"]).preset == "tiny"
