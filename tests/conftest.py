import os

import pytest
import torch

# One intra-op thread: the tests run tiny models, where thread hand-offs cost far more than they save
# (20x on a busy 2-core machine).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _threads_as_found():
    """A test that runs a command line in this process leaves torch's thread count as it found it: the team client
    sets it for a CPU engine (cores - 1), and the tests after it compared CPU products computed on 15 threads with
    a shard process's on one (bench/LOG.md section 69)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def usage_error(capsys):
    """usage_error(parse, argv): what a command line's `parse` (argparse, or a main) writes to stderr as it
    refuses argv with exit code 2, an ordinary mistake."""
    def refused(parse, argv):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err
    return refused


@pytest.fixture
def cli_here(capsys):
    """cli_here(main, prog, argv): (exit code, stderr) of a console script run in this process as its entry point
    runs it (client.cli.run_cli: one-line errors), argparse's refusals (SystemExit) included."""
    from client import cli

    def run(main, prog, argv):
        try:
            code = cli.run_cli(main, prog, argv)
        except SystemExit as exc:
            code = exc.code
        return code, capsys.readouterr().err
    return run


def checkout_env(root, **extra):
    """os.environ for a subprocess that runs this checkout's packages (root first on PYTHONPATH), not an installed
    copy, keeping the paths already set there (a folder of wheels on a GPU host)."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


_INTERPRETER_RUN = pytest.StashKey()  # the child running the Triton cases under the interpreter, if any


def _runs_triton_here() -> bool:
    """Whether this process runs the Triton kernels itself (under the interpreter, or on a GPU)."""
    from kernels._common import INTERPRET
    return INTERPRET or torch.cuda.is_available()


def pytest_collection_modifyitems(items):
    """Each file's check of its interpreter cases runs last, when the child running them has had the longest."""
    from triton_interpreter import CHECK_NAME
    items.sort(key=lambda item: item.name == CHECK_NAME)  # stable: the order is kept within each part


def pytest_collection_finish(session):
    """Start the child that runs the collected files' Triton cases under the interpreter (triton_interpreter.py)."""
    from triton_interpreter import CHECK_NAME, InterpreterRun
    if _runs_triton_here():
        return
    cases = {item.module.__file__: item.module.INTERPRETER_CASES for item in session.items
             if item.name == CHECK_NAME and hasattr(item.module, "INTERPRETER_CASES")}
    if cases:
        session.config.stash[_INTERPRETER_RUN] = InterpreterRun(cases)


def pytest_sessionfinish(session):
    run = session.config.stash.get(_INTERPRETER_RUN, None)
    if run is not None:
        run.stop()
    _name_threads_alive()


@pytest.fixture
def interpreter_cases(request):
    """The child running the Triton cases under the interpreter; check(__file__) fails unless this file's passed."""
    run = request.config.stash.get(_INTERPRETER_RUN, None)
    assert run is not None, "no interpreter run: this process runs the Triton kernels itself"
    return run


def run_side_by_side(commands, at_once=4, timeout=300, **popen):
    """[(exit code, stderr)] of each command, run `at_once` at a time: short runs that are mostly Python's and
    torch's imports take less time side by side, even on two cores."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def one(command):
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=timeout, **popen)
        return done.returncode, done.stderr

    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(one, commands))


def _name_threads_alive():
    """Name the threads still alive as the tests end, with where each is: a daemon thread inside a C++ call when the
    interpreter exits aborts the process ("terminate called without an active exception", bench/LOG.md sections 67
    and 69), after every test passed."""
    import sys
    import threading
    import traceback

    frames = sys._current_frames()
    alive = [t for t in threading.enumerate() if t is not threading.main_thread() and t.ident in frames]
    if alive:
        lines = [f"\nthreads alive at the end of the tests: {len(alive)}"]
        for thread in alive:
            where = traceback.format_stack(frames[thread.ident])[-2:]
            lines.append(f"  {thread.name} (daemon {thread.daemon}): " + " | ".join(
                " ".join(w.split()) for w in where))
        sys.stderr.write("\n".join(lines) + "\n")
