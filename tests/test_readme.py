"""The README keeps up with the code: every option of the server and of the team client is in its section, every
default it states is the option's, every file it cites is there, and every test its fault table names exists."""
import ast
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from client import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def options(command) -> set[str]:
    result = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    # each option's own line of the help, indented two spaces ("  --name ..." or "  -h, --help"), not options
    # named in a help text (its lines are indented further)
    return set(re.findall(r"^  (?:-\w, )?(--[a-z][a-z-]*)", result.stdout, re.M)) - {"--help"}


@pytest.mark.parametrize("command, title", [
    (["-m", "server"], "The scoring server"),
    (["team/example_model.py"], "The team client"),
])
def test_every_option_is_in_the_readme(command, title):
    text = section(title)
    missing = sorted(option for option in options(command) if not re.search(rf"(?<![\w-]){option}(?![\w-])", text))
    assert not missing, f"README section {title!r} does not name {', '.join(missing)}"


class _Parser(Exception):
    """Carries the parser a command's parse_args built, before it parses anything."""


def defaults(module, monkeypatch) -> dict:
    def grab(parser, *args, **kwargs):
        raise _Parser(parser)
    monkeypatch.setattr(cli.ArgumentParser, "parse_args", grab)
    with pytest.raises(_Parser) as caught:
        importlib.import_module(module).parse_args([])
    return {option: action.default for action in caught.value.args[0]._actions for option in action.option_strings}


def stated_default(value: str, text: str, default) -> str | None:
    """The default that the parenthesis after an option states: "`--flag VALUE` (the default", "(default X" or
    "(..., default X", or a leading number ("`--atol` (1e-3)") for a numeric option."""
    if text.startswith("the default"):
        return value or None
    said = re.search(r"(?:^|[;,] )default `?([\w.-]+)", text)
    if said:
        return said[1]
    number = re.match(r"-?\d[\d.]*(?:e-?\d+)?(?![\w.])", text)
    return number[0] if number and isinstance(default, (int, float)) else None


@pytest.mark.parametrize("module, title", [
    ("server.__main__", "The scoring server"),
    ("team.example_model", "The team client"),
    ("team.example_model", "Symbols at scale"),
    ("team.example_model", "Symbols over several hosts (Ray)"),
    ("local_evaluator", "Offline evaluation and profiling"),
])
def test_every_default_the_readme_states_is_the_options(module, title, monkeypatch):
    actual = defaults(module, monkeypatch)
    wrong = []
    for option, value, text in re.findall(r"`(--[a-z][a-z-]*) ?([\w.]*)[^`]*`\s+\(([^()]*)", section(title)):
        default = actual.get(option)
        if default is None or isinstance(default, bool) or (stated := stated_default(value, text, default)) is None:
            continue
        if not (float(stated) == default if isinstance(default, (int, float)) else stated == str(default)):
            wrong.append(f"{option}: README {stated}, code {default}")
    assert not wrong, f"README section {title!r}: {'; '.join(wrong)}"


def test_every_test_the_fault_table_names_exists():
    table = section("Strangers and faults")
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", table)
    assert len(named) >= 20
    defined = {}
    for file, test in named:
        if file not in defined:
            tree = ast.parse((ROOT / "tests" / file).read_text())
            defined[file] = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert test in defined[file], f"the README's fault table names {file}::{test}, which does not exist"


def cited_paths() -> set[str]:
    """The checkout's files and folders the README names."""
    return set(re.findall(r"(?<![\w/.-])((?:\.ci|bench|client|docs|kernels|scripts|server|team|tests)/[\w./-]*\w/?)",
                          README))


def test_every_file_the_readme_cites_exists():
    cited = cited_paths()
    assert len(cited) >= 50
    missing = sorted(path for path in cited if not (ROOT / path).exists())
    assert not missing, f"the README cites {', '.join(missing)}, which the checkout does not hold"


def test_every_console_script_is_in_the_readme():
    # what a stranger who installed the wheel, with no checkout to run scripts from, has to know the tools by
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    missing = sorted(name for name in scripts if not re.search(rf"`{name}`", README))
    assert not missing, f"the README does not name the console scripts {', '.join(missing)}"
