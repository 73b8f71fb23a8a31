"""The team's client: `process_batch` is the one place a team changes; main() plays a scoring server.

    python team/example_model.py --host H --port P      # play a running server
    python team/example_model.py --host H --port P --protocol tcp-json   # ... one of the original event's protocol
    python team/example_model.py --preset tiny           # start the project's server in-process and play it
"""
import os
import signal
import sys


# The console script (pyproject.toml) imports this module before it calls run(): started as it, Ctrl-C is taken over
# before the imports too, and its line names the console script (client.cli.prog_name's rule; not imported yet).
_CONSOLE_SCRIPT = bool(sys.argv) and os.path.basename(sys.argv[0]) == "fastens-team"
_INTERRUPTED = f"{'fastens-team' if _CONSOLE_SCRIPT else 'team/example_model.py'}: interrupted"


def _exit_at_ctrl_c(*_):
    print(_INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)  # not an exception: an import that catches every exception would swallow it and go on


def _ctrl_c_exits_until_serving():
    """Until the event loop takes Ctrl-C over (then it stops cleanly, with what was played so far), Ctrl-C
    exits at once with one line: nothing is lost while the imports, the model and the targets load. Left alone
    where Ctrl-C is ignored (a background job)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _exit_at_ctrl_c)


if __name__ == "__main__" or _CONSOLE_SCRIPT:
    _ctrl_c_exits_until_serving()  # first: the imports below take a second or two

# Runnable as a script from anywhere: the repository root holds the `client` and `server` packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

from client import cli, event_loop, protocol, team_api  # noqa: E402
from client.constants import DEFAULT_REQUESTS_PER_SYMBOL, DEFAULT_TIMEOUT_S  # noqa: E402
from client.engine import ENGINES, Engine, make_engine  # noqa: E402
from client.engine.options import add_engine_arguments, engine_options  # noqa: E402
from client.engine.base import NUM_TOWERS, CapacityError, PendingStep  # noqa: E402
from client.journal import SEGMENT_BYTES  # noqa: E402
from client.model.config import PRESETS  # noqa: E402
from client.runtime import CONNECT_TIMEOUT_S, SERVER_IDLE_S  # noqa: E402
from client.transport import PROTOCOLS  # noqa: E402


class ExampleModel:
    """Answers one micro-batch at a time. The runtime pipelines steps through submit_batch (the next step is
    queued on the GPU while the host sends the last one's answers); the local evaluator calls process_batch.

    A batch holds each waiting symbol's queued requests, several of a symbol in arrival order
    (requests_per_symbol = "many", client/team_api.py): the engine advances the symbol's state through them in
    one step."""

    requests_per_symbol = "many"

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def max_batch(self) -> int | None:
        """Symbols one engine step holds (a larger batch runs as several steps)."""
        return getattr(self.engine, "max_batch", None)

    @property
    def steps_in_background(self) -> bool:
        """Whether the engine's steps run while submit_batch returns and say when they end (client/team_api.py): not
        where a subclass changed process_batch, which submit_batch then computes (inline, it held the event loop)."""
        if type(self).process_batch is not ExampleModel.process_batch:
            return False
        return getattr(self.engine, "steps_in_background", False) is True

    @property
    def step_rows(self) -> tuple[int, ...]:
        """Rows the engine's steps of several requests a symbol run at, for the runtime's step clock."""
        return getattr(self.engine, "step_rows", ())

    def process_batch(self, requests_by_symbol: dict[str, list[tuple[int, np.ndarray]]]) -> dict:
        """{symbol: [(unique_id, features[79]), ...]}, each symbol's requests in arrival order within and across
        calls -> {"unique_ids": [...], "predictions": float32 [n, 4], "errors": {unique_id: why} for requests
        not answered (a symbol the engine has no room for, features not finite: the symbol's other requests step on
        from the state before it)}."""
        return self._submit(requests_by_symbol).result()

    def submit_batch(self, requests_by_symbol: dict[str, list[tuple[int, np.ndarray]]]) -> PendingStep:
        """Start process_batch's step without waiting for it: result() gives process_batch's answer.
        Batches advance the states in submission order, whenever their results are collected."""
        if type(self).process_batch is not ExampleModel.process_batch:
            # A subclass that changed only process_batch (the one place a team changes) must still be what
            # answers, so run it now rather than the example's own pipelined step.
            return PendingStep.completed(self.process_batch(requests_by_symbol))
        return self._submit(requests_by_symbol, joinable=True)

    @property
    def moves_states(self) -> bool:
        """Whether the engine may move a state off the GPU (a host tier): where it never does, the runtime neither
        prefetches (a thread woken per request, beside its step's) nor asks ready while a step forms."""
        return getattr(self.engine, "moves_states", True)

    @property
    def holds_back(self) -> bool:
        """Whether the engine's ready() may say False though its states never move (a sharded engine's, for a shard
        late to answer)."""
        return getattr(self.engine, "holds_back", False) is True

    def prefetch(self, symbols) -> None:
        """The runtime calls this when requests for these symbols arrive: the engine starts bringing their states
        to the GPU while other steps run."""
        self.engine.prefetch(symbols)

    def ready(self, symbol) -> bool:
        """The runtime's scheduler holds a symbol back while this is False (its state still on its way)."""
        return self.engine.ready(symbol)

    def state_layout(self):
        """The layout of the states export_state gives (the engine's), or None where they cannot be checkpointed (the
        journal's, client/journal.py): the engine cannot export them, or a subclass answers with a process_batch of
        its own, which may keep a state of its own beside the engine's."""
        if type(self).process_batch is not ExampleModel.process_batch:
            return None
        return self.engine.state_layout()

    def export_state(self, symbol) -> PendingStep:
        """The symbol's state after the steps submitted so far: result() a uint8 array, None where none is held."""
        return self.engine.export_state(symbol)

    def import_state(self, symbol, data) -> None:
        """The symbol's state set to what export_state gave, before the steps submitted after."""
        self.engine.import_state(symbol, data)

    def release(self, symbols) -> None:
        """Forget these symbols' states (the runtime's idle_timeout_s): their next requests start afresh."""
        self.engine.release(symbols)

    def _submit(self, requests_by_symbol, joinable=False) -> PendingStep:
        # A symbol the engine has no room for is answered with an error; the others step as usual.
        rejected = self.engine.unplaceable(list(requests_by_symbol))
        by_symbol = {s: team_api.queued(value) for s, value in requests_by_symbol.items()}
        not_finite = {}  # unique_id -> why: refused alone (the runtime refuses them on arrival; a direct call may not)
        while True:
            errors = {uid: why for s, why in rejected.items() for uid, _ in by_symbol[s]} | not_finite
            requests = [(s, uid, f) for s, queued in by_symbol.items() if s not in rejected for uid, f in queued]
            if not_finite:
                requests = [request for request in requests if request[1] not in not_finite]
            if not requests:
                return PendingStep.completed({"unique_ids": [], "predictions": np.zeros((0, NUM_TOWERS), np.float32),
                                              "errors": errors})
            symbols = [s for s, _, _ in requests]
            unique_ids = [uid for _, uid, _ in requests]
            features = np.stack([np.asarray(f, dtype=np.float32) for _, _, f in requests])
            if not (finite := np.isfinite(features).all(axis=1)).all():
                not_finite = {uid: "features contain NaN or inf" for uid, ok in zip(unique_ids, finite) if not ok}
                continue
            try:
                if joinable and getattr(self.engine, "takes_joins", False):
                    step = self.engine.submit(symbols, features, joinable=True)  # the runtime may join arrivals to it
                else:
                    step = self.engine.submit(symbols, features)
                break
            except CapacityError as exc:
                # a prefetch on the runtime's thread (a new symbol's arrival) took room that unplaceable counted: the
                # refusal changed no state, so its symbols are answered with it alone and the others step (refused
                # whole, every symbol of the step lost a request and went on out of step with the stream)
                refused = [s for s in exc.symbols if s in by_symbol and s not in rejected]
                if not refused:
                    raise
                rejected = {**rejected, **dict.fromkeys(refused, str(exc))}
        if hasattr(step, "join"):
            return _JoinableAnswer(step, unique_ids, errors)
        if not hasattr(step, "parts"):
            return PendingStep(lambda: {"unique_ids": unique_ids, "predictions": step.result(), "errors": errors},
                               poll=getattr(step, "done", None))
        return _PartedAnswer(step, unique_ids, symbols, errors)


class _JoinableAnswer(PendingStep):
    """submit_batch's answer for a step the engine queued with room for more (its JoinableStep): the runtime may
    join(unique_id, symbol, features) a request that arrives before the step starts, and fate(unique_id) says
    whether it made it (None until the step has read its inputs); result() answers the batch and the joins
    that made it."""

    def __init__(self, step, unique_ids, errors):
        super().__init__(self._answer, poll=getattr(step, "done", None))
        self.step, self.unique_ids, self.errors = step, unique_ids, errors
        self.joined = {}  # unique_id -> its index among the step's joins

    def join(self, unique_id, symbol, features) -> bool:
        if unique_id in self.joined or not self.step.join(symbol, features):
            return False
        self.joined[unique_id] = len(self.joined)
        return True

    def fate(self, unique_id) -> bool | None:
        return self.step.fate(self.joined[unique_id])

    def _answer(self):
        predictions = self.step.result()
        formed = len(self.unique_ids)
        taken = [(uid, formed + j) for uid, j in self.joined.items() if self.step.fate(j)]
        return {"unique_ids": self.unique_ids + [uid for uid, _ in taken],
                "predictions": predictions[[*range(formed), *(row for _, row in taken)]], "errors": self.errors}


class _PartedAnswer(PendingStep):
    """submit_batch's answer for a step the engine answers in parts (a sharded engine's, one part a shard): a part
    that failed (its shard lost, or without room) is an error for each of its requests; the others are answered.
    partial() answers the parts arrived so far without waiting, and wait(timeout) waits for the rest, so that the
    runtime can answer a step whose last part is late (a hung shard) without it (client/team_api.py). Its
    "restarted" names the first request of each symbol whose state the engine started afresh with this step (its
    shard lost, --on-shard-loss reset), so that the journal says where its old state ended."""

    def __init__(self, step, unique_ids, symbols, errors):
        super().__init__(lambda: self._answer(list(step.parts())))
        self.step, self.unique_ids, self.symbols, self.errors = step, unique_ids, symbols, errors

    def done(self) -> bool:
        return self.step.done()

    def wait(self, timeout: float) -> bool:
        return self.step.wait(timeout)

    def partial(self) -> dict:
        return self._answer(self.step.arrived())

    def _answer(self, parts) -> dict:
        restarted = self.step.restarted() if hasattr(self.step, "restarted") else set()  # of the parts taken, or more
        predictions = np.empty((len(self.unique_ids), NUM_TOWERS), np.float32)
        answered = np.zeros(len(self.unique_ids), bool)
        errors = dict(self.errors)
        first_rows = []  # each restarted symbol's first row in the step, where its part is among these
        for rows, outcome in parts:
            if isinstance(outcome, Exception):
                errors.update({self.unique_ids[row]: f"{type(outcome).__name__}: {outcome}" for row in rows})
            else:
                predictions[rows] = outcome
                answered[rows] = True
            if restarted:
                firsts = {}
                for row in rows:
                    if self.symbols[row] in restarted:
                        firsts.setdefault(self.symbols[row], row)
                first_rows += firsts.values()
        answer = {"unique_ids": [uid for uid, done in zip(self.unique_ids, answered) if done],
                  "predictions": predictions[answered], "errors": errors}
        if first_rows:
            answer["restarted"] = [self.unique_ids[row] for row in sorted(first_rows)]
        return answer


PROG = cli.prog_name("team/example_model.py")
DEFAULT_TEAM = "example"
EMBEDDED_STREAM = {"symbols": 20, "requests": 1000}  # the embedded server's stream unless --symbols, --requests
# --inline-steps as the runtime takes it: auto leaves it to the team client (client/team_api.py steps_in_background)
INLINE_STEPS = {"auto": None, "on": True, "off": False}
# What the user can do about each way a session can end badly (the runtime's outcome says what happened).
OUTCOME_HINTS = {
    "unreachable": "is the server running there? check --host and --port",
    "refused": "check --token and --team",
    "weights_mismatch": "start the client with the server's weights (its --preset and --seed, or --weights), "
                        "or pass --allow-weights-mismatch to play anyway",
    "cut_short": "the summary above covers what was played",
    "gave_up": "the summary above covers what was played; ask the server's organisers about it",
}


def _team_name(text):
    problem = protocol.team_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def parse_args(argv=None):
    import torch

    cuda = torch.cuda.is_available()
    parser = cli.ArgumentParser(prog=PROG, description="Play a scoring server with the team's client.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}"
                                                                    for code, meaning in cli.EXIT_CODES.items()))
    parser.add_argument("--host", type=cli.host_name,
                        help="server host; without it, start the project's server in-process")
    parser.add_argument("--port", type=cli.port_number, help="server port (required with --host)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="websocket",
                        help="the server's protocol: the project's websocket (default) or the original event's "
                             "newline-delimited JSON over TCP (tcp-json); the project's server speaks both")
    parser.add_argument("--tls", action="store_true",
                        help="the server at --host speaks over TLS (wss://, tcp+tls://; python -m server --tls-cert)")
    parser.add_argument("--tls-ca", type=cli.existing_file, metavar="FILE",
                        help="with --tls: trust a server certificate signed by this PEM file's certificates (a "
                             "self-signed server's own) instead of the system's authorities")
    parser.add_argument("--team-dir", metavar="DIR",
                        help="play the ExampleModel of DIR/example_model.py (the project's or the original event's "
                             "style) instead of this file's")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: full with CUDA, else tiny)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", type=cli.existing_file,
                         help="checkpoint path (default: synthetic weights from --seed)")
    weights.add_argument("--seed", type=cli.seed, default=0, help="seed of the synthetic weights (default 0)")
    parser.add_argument("--allow-weights-mismatch", action="store_true",
                        help="play even when the server's weights differ from the client's")
    parser.add_argument("--device", help="cuda or cpu (default cuda when present; with --cluster ray the shards' "
                                         "device, default GPUs where the cluster has any)")
    parser.add_argument("--engine", choices=ENGINES, help="default fast on CUDA, else reference")
    parser.add_argument("--team", type=_team_name,
                        help=f"the team's name: 1..{protocol.MAX_TEAM_NAME} printable characters (default "
                             f"{DEFAULT_TEAM}; websocket only: the original protocol registers no name)")
    parser.add_argument("--token", help="registration token, if the server wants one")
    parser.add_argument("--symbols", type=int, help=f"embedded server: number of symbols (default "
                                                     f"{EMBEDDED_STREAM['symbols']})")
    parser.add_argument("--requests", type=int, help=f"embedded server: number of requests (default "
                                                      f"{EMBEDDED_STREAM['requests']})")
    # typed: nan passed a check of `rate <= 0`, and was refused only once the model had loaded
    parser.add_argument("--rate", type=cli.request_rate, help="embedded server: requests/s (default: the stream's "
                                                                "gaps)")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file, help="write this client's summary as JSON")
    parser.add_argument("--journal", metavar="PATH", type=cli.output_file,
                        help="write every request answered to PATH (~370 bytes each) and, started again after a "
                             "crash, replay it and take the session back with its key; where the engine can export "
                             "its states, checkpoint them beside it (PATH.states) so the journal stays bounded and "
                             "a restart replays only what came after (client/journal.py); websocket only")
    parser.add_argument("--journal-segment-mb", type=cli.positive_float, default=SEGMENT_BYTES / 2**20,
                        metavar="MB", help=f"with --journal: close a segment of it past MB MiB, and checkpoint "
                                           f"the states of its symbols so it can go (default "
                                           f"{SEGMENT_BYTES / 2**20:g}: ~30 minutes at 400 requests/s; smaller "
                                           f"writes the states more often and replays less after a restart)")
    parser.add_argument("--server-idle-s", type=cli.positive_float, default=SERVER_IDLE_S, metavar="S",
                        help=f"leave (exit 6) when the server sends nothing, not even a heartbeat (or only heartbeats "
                             f"before answering the register), for S seconds (default {SERVER_IDLE_S:g}: three of "
                             f"its heartbeats); reconnect when a send waits as long; over tcp-json, whose event "
                             f"server says no end, leave (exit 0) once no request came for S seconds, all answered")
    parser.add_argument("--connect-timeout-s", type=cli.positive_float, default=CONNECT_TIMEOUT_S, metavar="S",
                        help=f"wait up to S seconds for the server at the first connection, retrying (default "
                             f"{CONNECT_TIMEOUT_S:g}: a wrong address fails fast; more for a client started before "
                             f"its server), then exit 3")
    parser.add_argument("--timeout-s", type=cli.positive_float, metavar="S",
                        help=f"the server's answer timeout, by which the summary counts an answer in time (a later one "
                             f"scores nothing), where the server does not say it: the original protocol (tcp-json) "
                             f"never does, a websocket server's welcome does (and wins); also the embedded server's "
                             f"(default {DEFAULT_TIMEOUT_S:g}, the project's server's: the original event's was never "
                             f"made public)")
    parser.add_argument("--inline-steps", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                        help="the event loop submits the steps and polls their ends itself, with no thread handing "
                             "a request or an answer on (it keeps a CPU busy while a step runs); on needs the fast "
                             "engine on one GPU; auto (default): on there, off elsewhere")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if args.host is not None and args.port is None:
        parser.error("--host needs --port")
    if args.host is None and args.port is not None:
        parser.error("--port without --host: give --host too, or neither to start the embedded server")
    if args.host is None and (args.tls or args.tls_ca):
        parser.error("--tls, --tls-ca: for the server at --host (the embedded server speaks without TLS)")
    if args.tls_ca is not None and not args.tls:
        parser.error("--tls-ca: with --tls (the certificates the server's is checked against)")
    if args.tls_ca is not None:  # a file of no certificate said now, not once the model has loaded (a minute for full)
        from client.transport import client_tls, server_url

        try:
            client_tls(server_url(args.protocol, args.host, args.port, tls=True), args.tls_ca)
        except ValueError as exc:
            parser.error(str(exc))
    # Given with --host they were ignored without a word: that server plays its own stream.
    embedded_only = [f"--{name}" for name in ("symbols", "requests", "rate") if getattr(args, name) is not None]
    if args.host is not None and embedded_only:
        parser.error(f"{', '.join(embedded_only)}: for the embedded server (no --host); the server at --host plays "
                     f"its own stream")
    for name, default in EMBEDDED_STREAM.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.symbols < 1 or args.requests < 1:
        parser.error("--symbols and --requests must be positive")
    if args.protocol == "tcp-json" and args.token is not None:
        parser.error("--token: the original protocol (tcp-json) has no field to carry it; a server that wants a "
                     "token needs --protocol websocket")
    if args.journal is not None:
        from client.journal import JournalError, check_file

        try:
            check_file(args.journal)
        except JournalError as exc:
            parser.error(str(exc))
    if args.journal is None and args.journal_segment_mb != SEGMENT_BYTES / 2**20:
        parser.error("--journal-segment-mb: with --journal (the segments are the journal's)")
    if args.protocol == "tcp-json" and args.journal is not None:
        parser.error("--journal: the original protocol (tcp-json) has no session a restarted client could take back "
                     "(the server names the team after its connection); use --protocol websocket")
    if args.protocol == "tcp-json" and args.team is not None:  # was dropped without a word
        parser.error("--team: the original protocol (tcp-json) registers no name (the server names the team after "
                     "its host); to play under a name of your own use --protocol websocket")
    args.team = args.team or DEFAULT_TEAM
    args.local_device = "cuda" if cuda else "cpu"
    if args.cluster is None:  # with --cluster ray the shards' device and engine follow the cluster's GPUs
        args.device = args.device or args.local_device
        args.engine = args.engine or ("fast" if cuda else "reference")
    if args.inline_steps == "on" and (args.engine != "fast" or not str(args.device).startswith("cuda") or args.gpus > 1
                              or args.cluster):
        # the fast engine's submit returns while its GPU steps, and its step says when it has ended; a step
        # computed in submit, or a sharded one (which cannot say), would hold the loop
        parser.error("--inline-steps needs --engine fast on one CUDA device: other engines compute a step in "
                     "submit or wait for it, which would hold the event loop that receives")
    args.team_class = ExampleModel
    if args.team_dir is not None:  # before the model loads: a wrong folder, or an option its class cannot use
        from local_evaluator import load_team_class

        args.team_class = load_team_class(args.team_dir)
    refuse_unusable_options(parser, args, args.team_class)
    if args.max_requests_per_symbol is None:
        args.max_requests_per_symbol = DEFAULT_REQUESTS_PER_SYMBOL
    if args.preset is None:
        args.preset = "full" if cuda else "tiny"
        print(f"--preset not given: using {args.preset} ({'CUDA present' if cuda else 'no CUDA'})", file=sys.stderr)
    return args


def refuse_unusable_options(parser, args, team_class):
    """Refuse, in the parser's one line, an option given that `team_class` cannot use (accepted, it was ignored
    without a word, or held the event loop): --max-requests-per-symbol above 1 for a class that takes one request
    of a symbol a step, --inline-steps on for one whose steps cannot run in the background."""
    from client.original_team import takes_several_requests

    name = (f"{os.path.join(args.team_dir, 'example_model.py')}'s ExampleModel" if args.team_dir is not None
            else team_class.__name__)
    if (args.max_requests_per_symbol or 1) > 1 and not takes_several_requests(team_class):
        parser.error(f"--max-requests-per-symbol {args.max_requests_per_symbol}: {name} takes one request of a "
                     f"symbol a step (its requests_per_symbol, client/team_api.py); leave the option out")
    if args.inline_steps != "on":
        return
    # by the classes that define them, not by identity with ExampleModel: a team file run beside this one as a
    # script subclasses another copy of it (team.example_model, not __main__)
    submit_from = next((c for c in team_class.__mro__ if "submit_batch" in vars(c)), None)
    process_from = next(c for c in team_class.__mro__ if "process_batch" in vars(c))
    if submit_from is None:
        parser.error(f"--inline-steps on: {name} has no submit_batch, so its steps cannot run in the background "
                     f"(the runtime's threads call its process_batch); leave the option out")
    if process_from is not submit_from and issubclass(process_from, submit_from):
        parser.error(f"--inline-steps on: {name} has a process_batch of its own, which the submit_batch it inherits "
                     f"computes on the event loop that receives (inline steps need steps that run in the "
                     f"background); leave the option out")


async def _print_progress(client):
    # One line rewritten in place on a terminal; a line every few seconds into a log file.
    live = sys.stderr.isatty()
    while True:
        await asyncio.sleep(0.5 if live else 5.0)
        if client.welcome is not None:  # its percentiles in a thread: over a long stream they take milliseconds
            line = await asyncio.to_thread(client.progress_line)
            print(("\r" if live else "") + line, end="" if live else "\n", file=sys.stderr, flush=True)


def _stop_on_signals(client, stopped_by: list) -> list:
    """The first Ctrl-C or SIGTERM (a service manager's stop, `docker stop`) stops the client cleanly: the summary
    so far is printed, the journal and an embedded server closed; a second one, while it stops, acts at once
    (KeyboardInterrupt, SIGTERM's default end). The signals that stopped it go into `stopped_by`; returns those
    it took over: none where a signal is ignored (a background job's Ctrl-C) or the loop takes none (Windows)."""
    loop = asyncio.get_running_loop()
    taken = []

    def first(signum):
        loop.remove_signal_handler(signum)  # back to the default for a second one
        stopped_by.append(signum)
        if signum == signal.SIGINT:
            print(file=sys.stderr)
        client.stop(None if signum == signal.SIGINT else signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue
        try:
            loop.add_signal_handler(signum, first, signum)
        except NotImplementedError:
            break
        taken.append(signum)
    return taken


def _describe_welcome(url, args, welcome, engine_text) -> str:
    if args.protocol == "tcp-json":  # the original protocol has no welcome: the runtime made one up
        return (f"playing {url} in the original protocol, as the team the server names (it registers no name); "
                f"the server's model is not said, weights not compared; {_describe_timeout(args, welcome)}; "
                f"{engine_text}")
    match = {True: "the same as this client's", None: "not compared",
             False: "OTHER than this client's (played anyway: --allow-weights-mismatch)"}[welcome["weights_match"]]
    return (f"playing {url} as team {args.team!r}: {welcome['requests']} requests over {welcome['symbols']} "
            f"symbols; the server's model is preset {welcome['preset']}, weights {welcome['weights_fingerprint']} "
            f"({match}); {_describe_timeout(args, welcome)}; {engine_text}")


def _describe_timeout(args, welcome) -> str:
    """The answer timeout by which the summary counts answers in time, and whose it is."""
    if "timeout_s" in welcome:
        said = f"answers count in time within the server's timeout, {welcome['timeout_s']:g} s"
        return said + (f" (--timeout-s {args.timeout_s:g} not used)"
                       if args.timeout_s not in (None, welcome["timeout_s"]) else "")
    if args.host is None:
        return f"answers count in time within the embedded server's timeout, {_timeout_s(args):g} s"
    unsaid = ("the original protocol does not say the server's timeout" if args.protocol == "tcp-json"
              else "the server's welcome does not say its timeout")
    if args.timeout_s is not None:
        return f"answers count in time within {args.timeout_s:g} s (--timeout-s: {unsaid})"
    return (f"answers count in time within {DEFAULT_TIMEOUT_S:g} s, the project's server's timeout ({unsaid}; "
            f"--timeout-s S to state it)")


def _timeout_s(args) -> float:
    return DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s


def _team_forgets_idle(args, team_class) -> bool:
    """Whether the team client forgets symbols idle for --idle-timeout (the runtime's idle_timeout_s) rather than
    its engine: with --journal, which then says where each was forgotten, so that a replay forgets it there too
    (the engine's forgets fall inside steps, where the journal cannot place them); where the team class can (its
    release, or in the event's style its engine's through the adapter)."""
    from client.original_team import BaseInferenceClient

    return (args.journal is not None and args.idle_timeout is not None
            and (callable(getattr(team_class, "release", None)) or issubclass(team_class, BaseInferenceClient)))


def build_engine(args, forgets_idle=True) -> tuple[Engine, str, str]:
    """(the engine args ask for, which forgets idle symbols itself unless not forgets_idle; the weights fingerprint;
    the engine in words). With --cluster ray the model is loaded by each shard, not here: the shards say the
    fingerprint."""
    from client.engine.sharded import ModelSpec
    from client.model import ModelLoader

    options = engine_options(args)
    if not forgets_idle:
        options["idle_timeout_s"] = None
    spec = ModelSpec(args.preset, args.weights, args.seed)
    weights = args.weights or f"seed {args.seed}"
    if args.cluster == "ray":
        print(f"preset {args.preset} ({weights}) on the Ray cluster at {args.ray_address or 'local'}", file=sys.stderr)
        engine = make_engine(args.engine, None, device=args.device, spec=spec, **options)
        shards = engine.describe()["shards"]
        return engine, engine.fingerprint, (f"engine {shards[0]['engine']} in {len(shards)} Ray shard(s) "
                                            f"({'; '.join(shard['where'] for shard in shards)})")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Leave a core to the event loop (and a server on this machine): on a 2-core machine the tiny model's
        # steps gain nothing from a second thread, and with it the client answered 143 of 1,000 requests in time
        # (the README's first command), with one thread all 1,000.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    # loaded by the engine that needs it (the fast engine drops it once its weights are converted)
    load = ModelLoader(args.preset, args.weights, args.seed, args.device,
                       say=f"loading preset {args.preset} ({weights}) on {args.device}, engine {args.engine}")
    engine = make_engine(args.engine, load, device=args.device, spec=spec, **options)
    # a sharded engine's shards load their own model and say its fingerprint
    fingerprint = load.fingerprint or engine.fingerprint
    return engine, fingerprint, f"engine {args.engine}, device {args.device}"


def _team_client(team_class, engine, team_dir):
    """The runtime's client of a team class built with the engine; a --team-dir file's class that fails to build
    (e.g. an __init__ that takes no engine) is that file's mistake, said in one line as the evaluator says it."""
    from client.original_team import as_runtime_client

    try:
        return as_runtime_client(team_class(engine))
    except Exception as exc:
        if team_dir is None:
            raise
        raise cli.CliError(f"{os.path.join(team_dir, 'example_model.py')}: ExampleModel(engine) failed: "
                           f"{type(exc).__name__}: {exc}") from exc


class _LossNotices:
    """Says each shard the engine loses to the client playing the stream (its summary's notices, and the server's
    leaderboard), not only on stderr: one lost while no client plays (the journal's replay, between streams) to the
    next one, once its run() has begun (notice() needs its loop)."""

    def __init__(self, engine):
        self._lock, self._client, self._waiting = threading.Lock(), None, []
        engine.on_loss(self._lost)

    def playing(self, client) -> None:
        """From now on losses go to `client` (None: to the next client), those waiting first."""
        with self._lock:
            self._client, waiting = client, [] if client is None else self._waiting
            if client is not None:
                self._waiting = []
        for loss in waiting:
            self._say(client, loss)

    def _lost(self, loss) -> None:  # an engine's thread
        with self._lock:
            client = self._client
            if client is None:
                self._waiting.append(loss)
                return
        self._say(client, loss)

    @staticmethod
    def _say(client, loss) -> None:
        client.notice("state_reset" if loss["policy"] == "reset" else "shard_lost", loss["line"])


def _replay_journal(args, url, fingerprint, team_client):
    """(the --journal's Journal, the Replayed of the requests it replayed through the team client: its session with
    this server, team and weights); (None, None) without --journal."""
    if args.journal is None:
        return None, None
    from client.journal import Journal, replay
    from client.runtime import CACHE_SIZE

    journal = Journal(args.journal, {"url": url, "team": args.team, "weights": fingerprint},
                      layout=team_api.state_layout(team_client), keep=CACHE_SIZE,
                      segment_bytes=max(1, int(args.journal_segment_mb * 2**20)))
    if not journal.replayable:
        return journal, None
    refused = f"; the {journal.refused:,} it refused are refused again, never stepped" if journal.refused else ""
    states = journal.checkpoints.covers if journal.checkpoints is not None else {}
    onto = f"the checkpointed states of {len(states):,} symbols" if states else "fresh states"
    requests = journal.count - journal.refused - journal.forgotten
    print(f"{PROG}: replaying the {requests:,} requests of {journal.symbols:,} symbols in the journal {args.journal} "
          f"onto {onto}{refused}", file=sys.stderr)
    replayed = replay(team_client, journal, CACHE_SIZE, team_api.step_symbols(team_client),
                      args.max_requests_per_symbol)
    return journal, replayed


async def play(args, stopped_by: list | None = None) -> tuple[dict, list[dict] | None]:
    """Play the server given by args (or an embedded one); return (client summary, server summaries). The signals
    that stopped it (Ctrl-C, SIGTERM) go into `stopped_by`."""
    stopped_by = [] if stopped_by is None else stopped_by
    from client.runtime import NEW_STREAM, StreamingClient
    from client.transport import server_url

    team_class = args.team_class
    team_forgets_idle = _team_forgets_idle(args, team_class)
    engine, fingerprint, engine_text = build_engine(args, forgets_idle=not team_forgets_idle)
    if team_forgets_idle:
        print(f"{PROG}: the team client forgets symbols idle {args.idle_timeout:g} s between steps, journaled",
              file=sys.stderr)
    elif args.journal is not None and args.idle_timeout is not None:
        print(f"{PROG}: the engine forgets symbols idle {args.idle_timeout:g} s inside its steps, where the journal "
              f"cannot place them (a restart replays a forgotten symbol onto its old state): give the team class a "
              f"release(symbols) to forget them between steps", file=sys.stderr)
    server = journal = None
    try:
        team_client = _team_client(team_class, engine, args.team_dir)  # before an embedded server computes targets
        if args.host is None:
            from server.app import ScoringServer, ServerConfig

            server = ScoringServer(ServerConfig(host="127.0.0.1", port=0, preset=args.preset, weights=args.weights,
                                                seed=args.seed, symbols=args.symbols, requests=args.requests,
                                                rate=args.rate, timeout_s=_timeout_s(args),
                                                device=args.local_device if args.cluster else args.device))
            url = server_url(args.protocol, "127.0.0.1", await server.start())
        else:
            url = server_url(args.protocol, args.host, args.port, args.tls)
        losses = _LossNotices(engine)  # before the journal's replay: a shard lost during it is said too
        session_key = None  # of the last welcome: a restarted server's new stream is the team it welcomed
        journal, replayed = _replay_journal(args, url, fingerprint, team_client)
        if replayed:
            session_key = journal.session_key  # the session it journaled, taken back
        while True:
            client = StreamingClient(team_client, url, args.team, args.token,
                                     preset=args.preset, weights_fingerprint=fingerprint,
                                     allow_weights_mismatch=args.allow_weights_mismatch, leave_at_end=True,
                                     max_requests_per_symbol=args.max_requests_per_symbol,
                                     server_idle_s=args.server_idle_s, connect_timeout_s=args.connect_timeout_s,
                                     timeout_s=_timeout_s(args),
                                     inline_steps=INLINE_STEPS[args.inline_steps], session_key=session_key,
                                     journal=journal, replayed=replayed, tls_ca=args.tls_ca,
                                     idle_timeout_s=args.idle_timeout if team_forgets_idle else None,
                                     on_welcome=lambda welcome: print(_describe_welcome(url, args, welcome,
                                                                                        engine_text), file=sys.stderr))
            began = asyncio.get_running_loop().call_soon(losses.playing, client)  # at run()'s first await
            replayed = None  # in the client's answer cache now; a new stream's client plays from fresh states
            progress = asyncio.create_task(_print_progress(client))
            signals = _stop_on_signals(client, stopped_by)
            try:
                summary = await client.run()
            finally:
                began.cancel()
                losses.playing(None)
                progress.cancel()
                for signum in signals:
                    asyncio.get_running_loop().remove_signal_handler(signum)
            if summary["outcome"] != NEW_STREAM:
                break
            # Its run has ended every step: the states are the engine's alone to drop, and a fresh team client
            # (a team file's own states too) plays the new stream from the start.
            print(f"{PROG}: {summary['detail']}; states reset, playing the new stream", file=sys.stderr)
            engine.release(engine.symbols)
            if journal is not None:
                journal.end_session()
            session_key = (client.welcome or {}).get("session_key", session_key)
            team_client = _team_client(team_class, engine, args.team_dir)
    finally:
        if server is not None:
            await server.stop()
        if journal is not None:
            journal.close()
        engine.close()
    if client.welcome is not None:
        print(("\r" if sys.stderr.isatty() else "") + client.progress_line(), file=sys.stderr)
    return summary, server.summaries() if server is not None else None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cluster is None:  # else --device is the shards', on the cluster
        cli.check_device(args.device)
    stopped_by = []
    summary, server_summaries = event_loop.run(play(args, stopped_by))
    print(json.dumps(summary, indent=2))
    if server_summaries:
        print("server summary: " + json.dumps(server_summaries, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    outcome = summary["outcome"]
    hint = OUTCOME_HINTS.get(outcome)
    print(f"{PROG}: {outcome.replace('_', ' ')}: {summary['detail']}" + (f"; {hint}" if hint else ""),
          file=sys.stderr)
    if outcome == "interrupted" and signal.SIGTERM in stopped_by:
        return cli.EXIT_TERMINATED
    return cli.EXIT_BY_OUTCOME[outcome]


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    _ctrl_c_exits_until_serving()
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
