"""The benchmark's output: timestamped progress on stderr (and a log file), the JSON report rewritten after every
update, and the summary table's number formatting."""
import json
import math
import os
import sys
import time

import numpy as np

from client import cli
from client.accuracy import percent_down


class Progress:
    """Timestamped progress lines on stderr, also appended to a log file when --log-dir is given."""

    def __init__(self, log_path=None):
        self.start = time.monotonic()
        self.log_path = log_path

    def __call__(self, message):
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.start:7.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a") as log_file:
                log_file.write(line + "\n")


def finite_or_none(value):
    """JSON-safe: non-finite floats become null (plain JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


class Report:
    """The results so far; written atomically after every update, so that a run cut off by a time limit still
    leaves the numbers it had."""

    def __init__(self, path):
        self.path = path
        self.data = {}

    def load(self):
        """Start from what the report's file already holds (--merge)."""
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as existing:
                    self.data = json.load(existing)
            except (ValueError, UnicodeDecodeError) as exc:
                raise cli.CliError(f"--merge: {self.path} holds no JSON report ({exc}); name another --json") from None
            if not isinstance(self.data, dict):
                raise cli.CliError(f"--merge: {self.path} holds no JSON report (a {type(self.data).__name__}); "
                                   f"name another --json")

    def update(self, **fields):
        self.data.update(finite_or_none(fields))
        if self.path is None:
            return
        tmp_path = f"{self.path}.tmp"
        with open(tmp_path, "w") as out:
            json.dump(self.data, out, indent=2, allow_nan=False)
        os.replace(tmp_path, self.path)


def fmt(value, digits=2):
    """A number for the summary or the progress log; "-" where there is none (no answer, no passing rate)."""
    return "-" if value is None else f"{value:.{digits}f}"


def rate_text(rate) -> str:
    """A max-rate search's result: its rate, or that none of the rates it tried passed (None)."""
    return "no rate tried passed" if rate is None else f"{rate:g} req/s"


def gate_line(accuracy) -> str:
    """An accuracy result's gate in a few words: passed or FAILED, and its worst family and tower."""
    gate = accuracy["gate"]
    worst = gate["worst"]
    verdict = "passed" if gate["passed"] else "FAILED"
    return f"gate {verdict} (worst {worst[0]} {worst[1]} {percent_down(worst[2]):.2f}%)"


def step_cells(step_ms) -> str:
    """Median step ms per batch size, in one line."""
    return ", ".join(f"B={b} {r['median']:.3f}" for b, r in step_ms.items())
