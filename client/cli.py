"""What every command line of the project shares: exit codes, one-line errors, --debug, progress lines.

A command line is a `main(argv) -> exit code` that builds its options with `ArgumentParser` (which adds
`--debug` and reports a bad option in one line) and raises on an ordinary mistake; `run_cli` turns what
it raises into one line on stderr and the exit code below:

    def main(argv=None) -> int:
        args = cli.ArgumentParser(prog="my_tool", description=...).parse_args(argv)
        if not Path(args.stream).is_file():
            raise cli.CliError(f"no stream at {args.stream}; make one with scripts/make_stream.py")
        ...
        return cli.EXIT_OK

    if __name__ == "__main__":
        sys.exit(cli.run_cli(main, "my_tool"))

Ordinary mistakes are CliError (with its own exit code), ValueError, OSError and ImportError: the
libraries here raise those with messages that say what is wrong; so is sys.exit("message"). Anything else
is a bug and exits 1. Tracebacks are printed only with --debug. A reader of the output that leaves early
(`| head`) ends the command quietly, exit 141.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import select
import sys
import tempfile
import time
import traceback

EXIT_OK = 0                  # done: for the team client, the stream was played to the end
EXIT_BUG = 1                 # an unexpected error (rerun with --debug for the traceback)
EXIT_USAGE = 2               # an ordinary mistake: bad option, missing file, unknown preset, port in use, the
                             # server speaks the other --protocol, or neither (a web server)
EXIT_UNREACHABLE = 3         # the team client never reached the server
EXIT_REFUSED = 4             # the server refused the team client (token, protocol version, team name)
EXIT_WEIGHTS_MISMATCH = 5    # the server's model has other weights than the team client's
EXIT_CUT_SHORT = 6           # connected, but the stream ended early (server gone, stopped, silent or failing)
EXIT_INTERRUPTED = 130       # Ctrl-C (128 + SIGINT, as shells report it)
EXIT_OUTPUT_CLOSED = 141      # the reader of the output left, `| head` (128 + SIGPIPE, as shells report it)
EXIT_TERMINATED = 143        # stopped by SIGTERM, cleanly (128 + SIGTERM, as shells report it)

EXIT_CODES = {  # code -> meaning, for --help epilogs and the README
    EXIT_OK: "played to the end (or done)",
    EXIT_BUG: "unexpected error (a bug: rerun with --debug for the traceback)",
    EXIT_USAGE: "ordinary mistake (bad option, missing file, unknown preset, port in use, other --protocol, ...)",
    EXIT_UNREACHABLE: "server unreachable",
    EXIT_REFUSED: "refused by the server (token, protocol, team name)",
    EXIT_WEIGHTS_MISMATCH: "weights differ from the server's",
    EXIT_CUT_SHORT: "cut short (the server went away, stopped, fell silent or failed the same way on every "
                    "connection before the end of the stream)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_OUTPUT_CLOSED: "the reader of the output left (| head)",
    EXIT_TERMINATED: "stopped by SIGTERM (the team client, with the summary so far)",
}

# The team client's exit code for each outcome of client.runtime's StreamingClient.
EXIT_BY_OUTCOME = {"complete": EXIT_OK, "unreachable": EXIT_UNREACHABLE, "refused": EXIT_REFUSED,
                   "weights_mismatch": EXIT_WEIGHTS_MISMATCH, "cut_short": EXIT_CUT_SHORT,
                   "gave_up": EXIT_CUT_SHORT, "interrupted": EXIT_INTERRUPTED, "wrong_protocol": EXIT_USAGE,
                   "new_stream": EXIT_CUT_SHORT}  # the team client plays a new stream on (team/example_model.py)

ORDINARY_ERRORS = (ValueError, OSError, ImportError)
MAX_MESSAGE_CHARS = 400


class CliError(Exception):
    """An ordinary mistake: the message says what is wrong and what to do; exit_code is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


class ArgumentParser(argparse.ArgumentParser):
    """argparse with `--debug` added and a bad option reported in one line (exit 2) instead of usage + error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="print tracebacks (and log more) on errors")

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def one_line(exc: BaseException | str, limit: int | None = MAX_MESSAGE_CHARS) -> str:
    """The exception's (or text's) message on one line (a multi-line message's lines joined), cut in the middle
    to about `limit` characters: the end often says what to do."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror and not text.startswith(exc.strerror):
        # OSError(errno, strerror, filename) prints as "[Errno 2] No such file or directory: 'x'"
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
    if limit is not None and len(text) > limit:
        head, tail = text[:2 * limit // 3].rstrip(), text[-limit // 3:].lstrip()
        text = f"{head} [... --debug shows all of it ...] {tail}"
    return text


def prog_name(default: str) -> str:
    """The name a tool's messages start with: the console script's where it was started as one (fastens-team),
    else `default` (how the README runs it from a checkout)."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv else ""
    return invoked if invoked.startswith("fastens-") else default


def run_cli(main, prog: str | None = None, argv: list[str] | None = None) -> int:
    """Run main(argv) and return its exit code, reporting what it raises in one line on stderr.

    `--debug` anywhere in argv (or FASTENS_DEBUG=1) prints the traceback first, and the whole message."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or os.path.basename(sys.argv[0])
    debug = "--debug" in argv or os.environ.get("FASTENS_DEBUG", "") not in ("", "0")
    limit = None if debug else MAX_MESSAGE_CHARS
    try:
        code = main(argv)
        sys.stdout.flush()  # what is still buffered: a reader that left breaks the pipe here, not at the exit
        return EXIT_OK if code is None else int(code)
    except SystemExit as exc:
        if not isinstance(exc.code, str):  # argparse's exit, or main's own code
            raise
        # sys.exit("message"): an error the program has already put in words (Python would exit 1)
        print(one_line(exc.code, limit), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        failure, code, message = exc, EXIT_INTERRUPTED, f"{prog}: interrupted"
    except CliError as exc:
        failure, code, message = exc, exc.exit_code, f"{prog}: error: {one_line(exc, limit)}"
    except ORDINARY_ERRORS as exc:
        if isinstance(exc, BrokenPipeError) and readers_left():
            return EXIT_OUTPUT_CLOSED
        failure, code, message = exc, EXIT_USAGE, f"{prog}: error: {one_line(exc, limit)}"
    except Exception as exc:  # a bug: still one line, with the way to its traceback
        failure, code = exc, EXIT_BUG
        message = f"{prog}: unexpected error: {type(exc).__name__}: {one_line(exc, limit)}" + (
            "" if debug else " (rerun with --debug for the traceback)")
    if debug:
        traceback.print_exception(failure)
    print(message, file=sys.stderr, flush=True)
    return code


def readers_left() -> bool:
    """Whether the reader of stdout or stderr has closed its pipe (`| head`): each such stream is pointed at
    /dev/null, so that nothing written later, nor the interpreter's flush at the exit, raises BrokenPipeError."""
    left = False
    for stream in (sys.stdout, sys.stderr):
        try:
            poller = select.poll()
            poller.register(stream.fileno(), select.POLLOUT)
            closed = any(events & select.POLLERR for _, events in poller.poll(0))  # a pipe's writer without reader
        except (AttributeError, ValueError, OSError):  # no poll (Windows), no file descriptor (a test's capture)
            continue
        if closed:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
            left = True
    return left


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1, or a one-line error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma list of integers of at least 1, or a one-line error."""
    return [positive_int(part) for part in text.split(",")]


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0, or a one-line error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


# requests/s: a stream's gaps (exponential, mean 1000/rate ms) stay far under its limit of a day a gap
MIN_RATE = 1e-3


def request_rate(text: str) -> float:
    """argparse type: requests per second, at least MIN_RATE, or a one-line error."""
    value = positive_float(text)
    if value < MIN_RATE:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_RATE:g} requests/s (a stream's gaps are at most a "
                                         f"day), got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0, or a one-line error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse type: a random seed, an integer of at least 0 (numpy's generators refuse a negative one, in words
    that name no option)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def port_number(text: str, lowest: int = 1) -> int:
    """argparse type: a TCP port, lowest..65535 (a server passes lowest=0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in {lowest}..65535, got {text!r}")
    return value


def host_name(text: str) -> str:
    """argparse type: a server's host name or address (an IPv6 one with or without its brackets). A url or
    host:port is refused here: in a url it failed only once the model had loaded, in words naming no option."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if "://" in text:
        raise argparse.ArgumentTypeError(f"takes a host name or address, not a url, got {text!r}: give the url's "
                                         f"port with --port (and --protocol tcp-json for tcp://)")
    if not host or any(c.isspace() or c in "/?#@[]" for c in host):
        raise argparse.ArgumentTypeError(f"must be a host name or address, got {text!r}")
    if ":" in host:  # only an IPv6 address has one
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a host name or address, got {text!r}: give the port with "
                                             f"--port") from None
    return host


def listen_port(text: str) -> int:
    """argparse type: a port to listen on, 0 (any free port) to 65535."""
    return port_number(text, lowest=0)


def output_file(text: str) -> str:
    """argparse type: a path to write at the end, checked now (its folder exists, it can be written) so that a
    long run does not fail at its last step."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    if text.endswith(os.sep):  # a missing folder's: open() refused it only at the end, pathlib wrote a file without "/"
        raise argparse.ArgumentTypeError(f"{text} names a folder; give a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no such folder: {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def writable_folder(folder) -> None:
    """Make `folder` where it is missing and create a file in it, raising OSError where either fails: for a tool
    that writes only after minutes of work. A file, since os.access passes any folder for root (/sys, /proc)."""
    os.makedirs(folder, exist_ok=True)
    tempfile.TemporaryFile(dir=folder).close()


def argument_type(parse):
    """An argparse type from `parse`, which raises ValueError with a one-line message: that message becomes the
    option's error."""
    def parse_argument(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse_argument


def existing_file(text: str) -> str:
    """argparse type: a path that is a file (else the option's error says which)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def check_device(device: str | None) -> None:
    """Refuse a device torch does not know, or a CUDA device on a torch without CUDA, before anything is built on
    it (torch's own refusal is a RuntimeError, which would read as a bug)."""
    if device is None:
        return
    import torch

    try:
        torch.device(device)
    except RuntimeError:
        raise CliError(f"--device {device}: not a torch device; use cpu, cuda or cuda:N") from None
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        # (not every command that takes --device has an --engine to choose)
        raise CliError(f"--device {device}, but this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")


def preset_for(preset: str | None, device) -> str:
    """The preset a command runs: the one given, else full on a CUDA device and tiny on the CPU (the full preset's
    weights alone take 8 GB of host memory, and a CPU step of it seconds), said on stderr."""
    if preset is not None:
        return preset
    preset = "full" if str(device).startswith("cuda") else "tiny"
    print(f"--preset not given: using {preset} on {device}", file=sys.stderr)
    return preset


def format_bytes(size: float) -> str:
    if size < 1000:
        return f"{size:.0f} B"
    for unit in ("kB", "MB"):
        size /= 1000
        if size < 1000:
            return f"{size:.1f} {unit}"
    return f"{size / 1000:.1f} GB"


class Progress:
    """Progress of a long step on stderr: on a terminal one line rewritten in place (5 times a second),
    elsewhere (a log, a CI run) one line every `every_s` seconds. Always ends with a final line."""

    def __init__(self, total: float, label: str, unit: str = "", every_s: float = 5.0, stream=None,
                 formatter=None):
        self.total, self.label, self.unit = total, label, unit
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.every_s = 0.2 if self.live else every_s
        self.format_amount = formatter or (lambda n: f"{n:,.0f}")
        self.start = self.last = time.monotonic()
        self.done = 0.0
        self.written = None  # the amount of the last line written
        self.closed = False

    def update(self, done: float) -> None:
        self.done = done
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        fraction = self.done / self.total if self.total else 1.0
        text = (f"{self.label}: {self.format_amount(self.done)}/{self.format_amount(self.total)}{self.unit} "
                f"({100 * fraction:.0f}%), {elapsed:.0f} s")
        if 0 < fraction < 1 and elapsed > 1:
            text += f", ~{elapsed * (1 - fraction) / fraction:.0f} s left"
        return text

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.live or self.written != self.done:  # off a terminal, an update may have written this line
                self._write(self.line())
            if self.live:
                self.stream.write("\n")
                self.stream.flush()

    def _write(self, text: str) -> None:
        self.written = self.done
        self.stream.write(f"\r{text}\033[K" if self.live else text + "\n")
        self.stream.flush()
