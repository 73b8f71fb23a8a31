"""client/event_loop.py: EVENT_LOOP picks the loop that the client, the server and bench.py run on."""
import asyncio
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from client import event_loop

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


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
    with pytest.raises(RuntimeError, match="uvloop is not installed"):
        event_loop.loop_factory()


def test_unknown_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="EVENT_LOOP must be one of asyncio, uvloop"):
        event_loop.loop_factory()


def test_the_package_refuses_a_python_without_asyncio_runner():
    # run() is asyncio.Runner, new in Python 3.11: on 3.10 every client and server would fail as it starts
    requires = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=(\d+)\.(\d+)", requires["project"]["requires-python"])
    assert floor and (int(floor[1]), int(floor[2])) >= (3, 11), requires["project"]["requires-python"]
