"""The test files' Triton cases on a CPU, through the interpreter: Triton reads TRITON_INTERPRET=1 when it is
imported and when @triton.jit decorates, so this process cannot switch to it, and a child pytest runs them.

One child runs the cases of every collected file that names them (its module-level `INTERPRETER_CASES`, a pytest
-k expression within that file), started as soon as collection ends, at the lowest CPU priority: it runs beside the
rest of the suite on the core the suite leaves idle (subprocesses it waits for, servers it waits on) and yields
the CPU to it otherwise. Each file's `test_triton_under_interpreter` is moved to the end of the run (conftest.py)
and reads its own cases' results there, so a failure is reported by the file it belongs to.
"""
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK_NAME = "test_triton_under_interpreter"
TIMEOUT_S = 1800  # the whole child, on a slow 2-core CPU: ~8 minutes of interpreted kernels


class InterpreterRun:
    """The child pytest running `cases` ({test file: its -k expression}) under the interpreter."""

    def __init__(self, cases: dict):
        from conftest import checkout_env

        self.cases = {Path(path).resolve(): keyword for path, keyword in cases.items()}
        self._dir = tempfile.TemporaryDirectory(prefix="triton-interpreter-")
        self._xml = Path(self._dir.name) / "cases.xml"
        self._log = open(Path(self._dir.name) / "child.log", "w+")
        selected = " or ".join(f"({path.name} and ({keyword}))" for path, keyword in self.cases.items())
        lowest_priority = ["nice", "-n", "19"] if shutil.which("nice") else []
        command = [*lowest_priority, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "--junitxml", str(self._xml), *map(str, self.cases), "-k", f"not {CHECK_NAME} and ({selected})"]
        self._process = subprocess.Popen(command, cwd=REPO, env=checkout_env(REPO, TRITON_INTERPRET="1"),
                                         stdout=self._log, stderr=subprocess.STDOUT)
        self._outcomes = None

    def check(self, test_file):
        """Fail unless the child ran this file's cases and every one passed (none skipped)."""
        outcomes = self._results()
        path = Path(test_file).resolve()
        mine = {name: outcome for (stem, name), outcome in outcomes.items() if stem == path.stem}
        assert mine, f"no case of {path.name} matching {self.cases.get(path)!r} ran:\n{self._log_tail()}"
        bad = {name: outcome for name, outcome in mine.items() if outcome != "passed"}
        assert not bad, "\n\n".join(f"{name}: {outcome}" for name, outcome in bad.items())

    def stop(self):
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._log.close()
        self._dir.cleanup()

    def _results(self) -> dict:
        """{(test file stem, case name): "passed", or what failed, errored or skipped it}, once the child ends."""
        if self._outcomes is None:
            try:
                self._process.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                pytest.fail(f"the interpreter's cases took over {TIMEOUT_S} s:\n{self._log_tail()}")
            if not self._xml.exists():
                pytest.fail(f"the interpreter's child pytest exited {self._process.returncode} with no results:\n"
                            f"{self._log_tail()}")
            self._outcomes = {}
            for case in ElementTree.parse(self._xml).iter("testcase"):
                stems = case.get("classname", "").split(".")
                stem = next((part for part in stems if part.startswith("test_")), "")
                outcome = "passed"
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        outcome = f"{child.tag}: {child.get('message', '')}\n{(child.text or '')[-3000:]}"
                self._outcomes[stem, case.get("name")] = outcome
        return self._outcomes

    def _log_tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-6000:]
