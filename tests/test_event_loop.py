"""client/event_loop.py: EVENT_LOOP picks the loop that the client, the server and bench.py run on."""
import asyncio
import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

from client import event_loop
from conftest import run_side_by_side

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None
ROOT = Path(__file__).resolve().parent.parent


async def _loop_class():
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_when_asked(monkeypatch):
    monkeypatch.setenv("EVENT_LOOP", "asyncio")
    assert event_loop.run(_loop_class()).startswith("asyncio")


def test_default_is_uvloop_where_installed(monkeypatch):
    monkeypatch.delenv("EVENT_LOOP", raising=False)
    assert event_loop.run(_loop_class()).startswith("uvloop" if HAS_UVLOOP else "asyncio")


@pytest.mark.skipif(HAS_UVLOOP, reason="uvloop is installed here")
def test_uvloop_required_but_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EVENT_LOOP", "uvloop")
    with pytest.raises(ImportError, match="uvloop is not installed"):  # an ordinary mistake (exit 2), not a bug
        event_loop.loop_factory()


@pytest.mark.skipif(HAS_UVLOOP, reason="uvloop is installed here")
def test_a_command_line_on_a_missing_uvloop_says_so_in_one_line():
    # it was an "unexpected error" (exit 1), then two lines of Python's warning that its coroutine never ran; the
    # server said it only after its targets
    commands = [[sys.executable, "team/example_model.py", "--requests", "4"], [sys.executable, "-m", "server"]]
    runs = run_side_by_side(commands, cwd=ROOT, env={**os.environ, "EVENT_LOOP": "uvloop"}, timeout=120)
    for (code, stderr), prog in zip(runs, ("team/example_model.py", "python -m server")):
        assert code == 2 and stderr.splitlines()[-1] == (
            f"{prog}: error: EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)"), stderr
        assert "loading preset" not in stderr


def test_unknown_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="EVENT_LOOP must be one of asyncio, uvloop"):
        event_loop.loop_factory()


def test_the_package_refuses_a_python_without_asyncio_runner():
    # run() is asyncio.Runner, new in Python 3.11: on 3.10 every client and server would fail as it starts
    requires = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=(\d+)\.(\d+)", requires["project"]["requires-python"])
    assert floor and (int(floor[1]), int(floor[2])) >= (3, 11), requires["project"]["requires-python"]
