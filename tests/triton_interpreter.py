"""Runs a test file's Triton cases on the CPU: in a child pytest with TRITON_INTERPRET=1, because Triton reads
that variable when it is imported and when @triton.jit decorates, so this process cannot switch to it."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_under_interpreter(test_file, keyword):
    """Run the tests of `test_file` selected by `keyword` (pytest -k) under the interpreter; all must run
    and pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(test_file),
                          "-k", keyword], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = ([line for line in out.stdout.splitlines() if line.strip()] or [""])[-1]
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, out.stdout[-2000:]
