"""The streaming client runtime: an asyncio client around a team client's process_batch.

The event loop only receives, validates, queues and sends (a team client's prefetch runs on a thread of its own,
so that its state table's lock and copies never hold receiving up); a worker thread pulls micro-batches
(client.scheduler: each waiting symbol's oldest requests, up to max_requests_per_symbol of a symbol, in the team
client's format, client/team_api.py) and runs the model step, so receiving never stalls.
A team client with submit_batch is pipelined instead: a submitter thread forms and submits the next
batch while the previous step still runs (behind a long step, just before it ends: client/step_clock.py), and a
completer thread collects the steps in submission order, so the host's per-step work overlaps the GPU's; with
inline_steps the event loop does both itself, polling the steps in flight (no thread hand-off on a request's way).
Each step's predictions are sent as soon as they are ready. Per-symbol states live in the engine, so they survive
reconnects; a bounded cache answers ids that the server resends after a reconnect without stepping the model
twice. The server's protocol (websocket or the original event's tcp-json) is the transport's business
(client/transport.py).
"""
import asyncio
import concurrent.futures
import gc
import logging
import math
import queue
import sys
import threading
import time
from collections import OrderedDict, deque

import numpy as np
from client import protocol, transport
from client.answers import check_answer
from client.constants import DEFAULT_REQUESTS_PER_SYMBOL, DEFAULT_TIMEOUT_S, NUM_FEATURES, NUM_TOWERS
from client.id_ranges import IdBits, IdRanges
from client import team_api
from client.scheduler import Request, Scheduler
from client.step_clock import StepClock

log = logging.getLogger(__name__)

# Close codes after which reconnecting cannot help: the server refused this client.
_REFUSED_CLOSE_CODES = {1002, 1003, 1007, 1008}

# How a session ended (the summary's "outcome"; client/cli.py maps each to an exit code).
COMPLETE = "complete"                  # the server said the stream is over (`end`)
UNREACHABLE = "unreachable"            # the first connection never succeeded
REFUSED = "refused"                    # the server refused this client (token, protocol, team name)
WEIGHTS_MISMATCH = "weights_mismatch"  # the server's model has other weights than this client's
CUT_SHORT = "cut_short"                # connected, then the server went away, stopped or fell silent before the end
GAVE_UP = "gave_up"                    # the server failed the same way on GIVE_UP_REPEATS connections in a row
INTERRUPTED = "interrupted"            # stop() before the end (Ctrl-C in the team client)
WRONG_PROTOCOL = "wrong_protocol"      # the server speaks the other protocol (websocket, tcp-json), or neither
NEW_STREAM = "new_stream"              # after a reconnect the server began another stream (its ids started over)
OUTCOMES = (COMPLETE, UNREACHABLE, REFUSED, WEIGHTS_MISMATCH, CUT_SHORT, GAVE_UP, INTERRUPTED, WRONG_PROTOCOL,
            NEW_STREAM)

# Connections in a row that may end the same way, with no new request in between, before the client gives up
# (with the backoff between them, about 1.5 s): a server that breaks every connection is not retried forever.
GIVE_UP_REPEATS = 5
# Seconds without any frame from the server (it sends a heartbeat every 5 s) before the session is cut short.
SERVER_IDLE_S = 15.0
# Seconds the first connection is retried: a wrong address fails fast.
CONNECT_TIMEOUT_S = 3.0
# After stop(), how long the steps in flight have to be answered and their answers to go out before the connection is
# closed: closed at once, the answers of the steps already on the GPU were computed and never sent (the server counted
# them missed).
STOP_DRAIN_S = 2.0

SWITCH_INTERVAL_S = 0.0002
# Pipelined steps in flight: one running on the GPU and the next queued behind it. More would only add
# queueing latency; the GPU's stream order advances each symbol's state in submission order.
PIPELINE_DEPTH = 2
# The next step is formed while one runs (just before it ends, client/step_clock.py) only when this many
# symbols already have work, else when the GPU is free: waiting for the GPU puts the host's per-step work
# (~0.4 ms) between steps. Measured on an H100 (bench/LOG.md, sections 12 and 14), when the next step was
# formed as soon as the previous was submitted: 1 gave p50 4.0 ms against 5.0 at 400 req/s.
PIPELINE_MIN_BATCH = 1
# While every waiting symbol's state is still on its way to the GPU (the team client's ready() is False), the
# model thread looks again this often (or at the next arrival); so does the submitter while the pipeline is full
# and such states may still join its queued step.
READY_POLL_S = 0.0005
# submits at which every symbol a closed segment of the journal waits for was in a step, before the oldest is held out
# of steps for its checkpoint (_checkpoint)
CHECKPOINT_MISSES = 16
# A step answered in parts (a sharded engine's, client/team_api.py) whose last parts have not come this long after
# it was submitted is answered for those that have, and the pipeline goes on without it: the symbols of its missing
# parts wait alone (a hung shard held every symbol until --shard-timeout-s, 60 s). A step takes milliseconds.
LATE_PARTS_S = 0.2
# While such a step waits for its late parts, the runtime looks this often whether they have come.
LATE_POLL_S = 0.005
MAX_FAILURES_LOGGED = 100  # distinct failures of the team's steps logged with their traceback
NON_FINITE_PREDICTION = "the team client's prediction is not finite (NaN or inf)"
MAX_ERRORS_LOGGED = 100  # distinct reasons for requests not answered, each logged once (the summary counts them all)
# Received ids a score may still count for: a score comes within the server's timeout (2 s), or on the next
# connection (the server sends again those of its last 30 s); at 20,000 requests a second 50 s of them, ~85 MB.
MAX_UNSCORED = 1_000_000
# answers kept for the server's resends (~0.5 KB each: 100 MB); a resend of an older id is refused, never stepped again
CACHE_SIZE = 200_000
# refused ids told apart as such (a resend is 'rejected earlier'; ~140 B each: 27 MB); older ones join the ranges of
# ids gone from the cache, still refused, never stepped, and a bit each tells them from the answers there
REFUSALS_KEPT = 200_000


class LatencyHistogram:
    """Latencies (ms, >= 0) counted in log-spaced bins 0.1% wide from 1 us to ~2.7 hours: percentiles within 0.05% of
    the exact ones (interpolated between ranks as numpy's), in constant memory (184 KB) and time however long the
    session. (A buffer of every latency grew 8 B a request, and its percentiles took 0.3 s of a core at 14M
    latencies, ten hours at 400 requests/s, for each progress line.) Added on the event loop, read from the team
    client's progress thread: a reader copies the counts, so at worst it misses the latest scores."""

    LOW_MS, RATIO, BINS = 1e-3, 1.001, 23_000

    def __init__(self):
        self._counts = np.zeros(self.BINS, dtype=np.int64)
        self.total_ms, self.min_ms, self.max_ms = 0.0, math.inf, -math.inf

    def add(self, latencies_ms) -> None:
        values = np.asarray(latencies_ms, dtype=np.float64)
        if not values.size:
            return
        bins = np.log(np.maximum(values, self.LOW_MS) / self.LOW_MS) / math.log(self.RATIO)
        # the extremes before the counts: a reader between them saw counts with min inf, max -inf (nan percentiles)
        self.min_ms, self.max_ms = min(self.min_ms, float(values.min())), max(self.max_ms, float(values.max()))
        self.total_ms += float(values.sum())
        np.add.at(self._counts, np.minimum(bins.astype(np.int64), self.BINS - 1), 1)

    def percentiles(self, qs) -> list[float] | None:
        counts = self._counts.copy()
        n = int(counts.sum())
        if not n:
            return None
        cumulative = np.cumsum(counts)
        ranks = np.asarray(qs, dtype=np.float64) / 100.0 * (n - 1)
        below, above = np.floor(ranks).astype(np.int64), np.ceil(ranks).astype(np.int64)

        def value(rank):  # the rank-th smallest (from 0): its bin's middle, the extremes as seen
            middle = self.LOW_MS * self.RATIO ** (np.searchsorted(cumulative, rank, side="right") + 0.5)
            return np.where(rank == 0, self.min_ms, np.where(rank == n - 1, self.max_ms,
                                                             np.clip(middle, self.min_ms, self.max_ms)))

        low, high = value(below), value(above)
        return (low + (ranks - below) * (high - low)).tolist()


class ClientStats:
    """What this client received and sent, and the server's score updates (progress line and summary)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        # the server's (its welcome says it; this until then, and for good over the original protocol, which has no
        # welcome): a later answer is scored but counts as missed
        self.timeout_ms = timeout_s * 1000.0
        self.requests = 0          # distinct request ids received
        self.rejected = 0          # of those, the ones answered with an error (NaN/inf features, a malformed frame)
        self.responses_sent = 0    # ids answered from a model step
        self.resent_from_cache = 0
        self.connections = 0
        self.scored = 0            # requests the server scored as answered in time
        self.correct_towers = 0
        self.pnl = 0.0
        # the latencies scored in time (summary() reads them also from the team client's progress thread: a list
        # made an array for each progress line, and three percentiles, held the event loop 73 ms at 1M scored)
        self._latencies = LatencyHistogram()
        # ids received and not yet scored, of the last MAX_UNSCORED received: a score for any other id (scored
        # already, never this client's request, or received that long ago) is not counted, so that a server's scores
        # cannot push responses past requests; a server that scored none kept every id (~70 B a request) for good
        self._unscored: set[int] = set()
        self._received: deque = deque()  # the ids of _unscored (and some scored since), oldest first
        self._first_request_at: float | None = None
        self._last_score_at: float | None = None

    def note_request(self, uid: int):
        if self._first_request_at is None:
            self._first_request_at = time.perf_counter()
        self.requests += 1
        self._unscored.add(uid)
        self._received.append(uid)
        if len(self._received) > MAX_UNSCORED:
            self._unscored.discard(self._received.popleft())

    def note_rejected(self, uids) -> None:
        """Requests noted, then answered with an error: a server scores only answers, so they wait for no score
        (kept, each failed request of a lost shard's symbols would hold an entry for the session)."""
        self.rejected += len(uids)
        self._unscored.difference_update(uids)

    def add_scores(self, msg: dict) -> None:
        ids, pnls, correct, latencies = (msg["unique_ids"], msg["pnls"], msg["correct"], msg["latencies_ms"])
        if not len(ids) == len(pnls) == len(correct) == len(latencies):
            raise protocol.ProtocolError(f"score_update: lengths differ: {len(ids)} ids, {len(pnls)} pnls, "
                                         f"{len(correct)} correct, {len(latencies)} latencies")
        if not all(0 <= towers <= NUM_TOWERS for towers in correct):
            raise protocol.ProtocolError(f"score_update: correct must count towers, 0..{NUM_TOWERS}")
        protocol.check_score_values(ids, pnls, latencies)
        in_time, in_time_towers = [], 0
        for uid, pnl, towers, latency in zip(ids, pnls, correct, latencies):
            if uid not in self._unscored:
                continue
            self._unscored.remove(uid)
            self.pnl += pnl
            if latency <= self.timeout_ms:
                in_time.append(latency)
                in_time_towers += towers
        self._latencies.add(in_time)
        self.scored += len(in_time)
        self.correct_towers += in_time_towers
        self._last_score_at = time.perf_counter()

    def summary(self) -> dict:
        # the counts first, together: the percentiles let the event loop score on meanwhile (the progress thread)
        scored, correct_towers = self.scored, self.correct_towers
        latencies = self._latencies
        p50, p90, p99 = latencies.percentiles([50, 90, 99]) or (None, None, None)
        elapsed = ((self._last_score_at - self._first_request_at)
                   if self._first_request_at is not None and self._last_score_at is not None else 0.0)
        return {
            "requests": self.requests,
            "responses": scored,
            "missed": self.requests - scored,
            "errors": self.rejected,
            "accuracy": correct_towers / (NUM_TOWERS * scored) if scored else None,
            "latency_ms": {"p50": p50, "p90": p90, "p99": p99,
                           "mean": latencies.total_ms / scored if scored else None,
                           "max": latencies.max_ms if scored else None},
            "responses_per_s": scored / elapsed if elapsed > 0 else None,
            "pnl": self.pnl,
            "responses_sent": self.responses_sent,
            "resent_from_cache": self.resent_from_cache,
            "connections": self.connections,
            "timeout_s": self.timeout_ms / 1000.0,  # the timeout by which responses and missed were counted
        }

    def progress_line(self, total: int | None = None) -> str:
        s = self.summary()
        acc = f"{s['accuracy']:.3f}" if s["accuracy"] is not None else "-"
        p50, p99 = s["latency_ms"]["p50"], s["latency_ms"]["p99"]
        lat = f"{p50:.1f}/{p99:.1f} ms" if p50 is not None else "-"
        requests = f"{s['requests']}/{total}" if total is not None else f"{s['requests']}"
        return (f"requests {requests}  responses {s['responses']}  accuracy {acc}  "
                f"latency p50/p99 {lat}  pnl {s['pnl']:.2f}")


class StreamingClient:
    """Plays a scoring server at `url` (ws://host:port, or tcp://host:port for the original protocol) with the team
    client until the session ends.

    The team client needs process_batch(requests_by_symbol) -> {"unique_ids", "predictions"}; if it also
    has submit_batch(requests_by_symbol) -> an object whose result() gives that dict, steps are pipelined. A
    step carries up to max_requests_per_symbol queued requests of a symbol when the team client takes lists
    (client/team_api.py), else one. A pipelined step answered in parts (a sharded engine's) whose last parts have
    not come late_parts_s after it was submitted is answered for those that have, and the next steps form without
    it: the symbols of its missing parts (a hung shard's) wait for them alone.

    Register names the client's model (preset, weights_fingerprint): a server with other weights refuses it
    unless allow_weights_mismatch; the server's `welcome` names its own (summary's weights_match), and its answer
    timeout, by which the summary counts answers in time (timeout_s until then, and throughout over the original
    protocol, which has no welcome: the summary's timeout_s says which it counted by). The session ends
    - at the server's `end` (every request scored) when leave_at_end, else when the server then closes; a
      harness that ends the session itself (stop()) after reading the server's summary leaves it False; over the
      original protocol, whose event server says no end, also once no request came for server_idle_s, all answered;
    - when the server refuses the client or closes with code 1000 (server stopped);
    - when the first connection fails for `connect_timeout_s` (a wrong host or port fails fast), or a lost
      connection cannot be made again for `give_up_after_s` (reconnects back off exponentially);
    - when the server speaks the other protocol (the detail names the flag to pass), or neither (a web server);
    - when give_up_repeats connections in a row end the same way (the same close, or the same refusal of a
      limit that passes) with no new request between them;
    - when the server sends nothing, not even a heartbeat, for server_idle_s, or nothing but heartbeats before it
      answers the register;
    - at stop().
    The summary's "outcome" says which (one of OUTCOMES) and "detail" says it in words.
    """

    def __init__(self, team_client, url: str, team: str, token: str | None = None, *,
                 preset: str | None = None, weights_fingerprint: str | None = None,
                 allow_weights_mismatch: bool = False, leave_at_end: bool = False, on_welcome=None,
                 max_batch: int | None = None, max_requests_per_symbol: int = DEFAULT_REQUESTS_PER_SYMBOL,
                 heartbeat_s: float = 5.0, backoff_s: float = 0.1, backoff_max_s: float = 5.0,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, give_up_after_s: float = 10.0,
                 cache_size: int = CACHE_SIZE, timeout_s: float = DEFAULT_TIMEOUT_S,
                 pipeline_min_batch: int = PIPELINE_MIN_BATCH,
                 form_late: bool = True, late_after_s: float | None = None, form_margin_s: float | None = None,
                 punctual_late_after_s: float | None = None, join_queued: bool = True, timeline: bool = False,
                 give_up_repeats: int = GIVE_UP_REPEATS,
                 server_idle_s: float = SERVER_IDLE_S, ws_compression: bool = False, step_log: bool = False,
                 inline_steps: bool | None = None, late_parts_s: float = LATE_PARTS_S,
                 session_key: str | None = None, journal=None, replayed=None, tls_ca: str | None = None,
                 idle_timeout_s: float | None = None):
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer or None, got {max_batch!r}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be positive, got {cache_size!r}")
        if max_requests_per_symbol < 1:
            raise ValueError(f"max_requests_per_symbol must be a positive integer, got {max_requests_per_symbol!r}")
        if (heartbeat_s <= 0 or backoff_s <= 0 or backoff_max_s < backoff_s or give_up_after_s < 0
                or connect_timeout_s <= 0 or give_up_repeats < 1 or not server_idle_s > 0):
            raise ValueError("need heartbeat_s > 0, 0 < backoff_s <= backoff_max_s, connect_timeout_s > 0, "
                             "give_up_after_s >= 0, give_up_repeats >= 1 and server_idle_s > 0")
        if idle_timeout_s is not None and not (idle_timeout_s > 0 and callable(getattr(team_client, "release", None))):
            raise ValueError(f"idle_timeout_s must be positive and the team client able to forget a symbol "
                             f"(release), got {idle_timeout_s!r} and {type(team_client).__name__}")
        self.give_up_repeats, self.server_idle_s = give_up_repeats, server_idle_s
        # the team client forgets a symbol idle this long, between steps, and the journal says where (_forget_idle):
        # symbol -> when its latest request came or stepped, least recent first; None: never
        self.idle_timeout_s = idle_timeout_s
        self._last_use: OrderedDict | None = None if idle_timeout_s is None else OrderedDict()
        self.forgotten_idle = 0
        self.ws_compression = ws_compression  # offer permessage-deflate (off: client/websocket_transport.py)
        # a url over TLS (wss://, tcp+tls://): the server's certificate checked against tls_ca's authorities, or the
        # system's (a file that holds none is said here, before anything is played)
        self._tls = transport.client_tls(url, tls_ca)
        # the server's, from its welcome: what a reconnect presents (given: the welcome's of an earlier client of the
        # team, whose server began the new stream this one plays)
        self._session_key = session_key
        # client/journal.py: each step's answered requests written before the answers go, each refused one before
        # its error goes; `replayed` (Replayed), what a restarted client replayed of the journal's session (its key
        # given as session_key), answers a resend of those ids, or refuses it again where they were refused
        self.journal, self._replayed = journal, bool(replayed)
        # how the last give_up_repeats connections since the last new request ended (all of them grew a tuple a
        # reconnect for good where they ended in turns two ways)
        self._failures: deque = deque(maxlen=give_up_repeats)
        self._frames = 0                      # frames received (the idle watch compares counts)
        self._unsure_mismatches = 0           # connections that ended in a ProtocolMismatch not certain (_session)
        self._last_request_at = 0.0           # monotonic time of the connection's start or its latest request
        self.team_client = team_client
        self.url, self.team, self.token = url, team, token
        self.preset, self.weights_fingerprint = preset, weights_fingerprint
        self.allow_weights_mismatch, self.leave_at_end = allow_weights_mismatch, leave_at_end
        self.on_welcome = on_welcome  # called with the server's first welcome: the client is playing
        self.connect_timeout_s = connect_timeout_s
        self.welcome: dict | None = None
        self.outcome: str | None = None
        self.detail = ""
        self._stopped_why: str | None = None  # stop()'s why
        self._ended = False                 # the server's end arrived
        self._welcomed = False              # the server welcomed the current connection
        self._refusal: dict | None = None   # the server's last error on this connection before its welcome
        self.max_batch = max_batch
        self.max_per_symbol = team_api.max_per_symbol(team_client, max_requests_per_symbol)
        # A step of this many symbols with max_per_symbol requests each is full (formed at once, _submit_in)
        self._full_step = max_batch if max_batch is not None else team_api.step_symbols(team_client)
        self.heartbeat_s, self.backoff_s, self.backoff_max_s = heartbeat_s, backoff_s, backoff_max_s
        if pipeline_min_batch < 1:
            raise ValueError(f"pipeline_min_batch must be a positive integer, got {pipeline_min_batch!r}")
        self.pipeline_min_batch = pipeline_min_batch
        # False: the next step is formed as soon as the one in flight is submitted (what the runtime did before
        # client/step_clock.py; kept to measure the two against each other)
        self.form_late = form_late
        # A request arriving while a step waits on the GPU behind another joins that step when the team client's
        # pending step takes it (join, fate: team/example_model.py), instead of waiting for the step after it
        # (bench/LOG.md section 56); False: never (to measure the two against each other)
        self.join_queued = join_queued
        self.joins = {"taken": 0, "missed": 0}  # joins that made it into their step, and those put back
        # The event loop forms, submits and answers the pipelined steps itself (_pump), polling the steps in flight
        # on each of its turns, instead of handing each request to a submitter thread and each answer back from a
        # completer: no thread waits to be woken on a request's way (a host that stalls its CPUs makes each such
        # wake-up a chance of milliseconds, bench/LOG.md sections 49-61); it spins one CPU while a step is in flight.
        # A team client with process_batch alone keeps its worker thread. No timed wait: late_wakes stays 0.
        # None: inline where the team client's steps run in the background and say when they end (a step computed
        # in submit would hold the loop that receives); lower p50 and p99 at the event's load on every H100 host
        # measured, quiet or stalling, and no lower max rate (bench/LOG.md section 62).
        if inline_steps is None:
            inline_steps = team_api.steps_in_background(team_client)
        self.inline_steps = inline_steps and callable(getattr(team_client, "submit_batch", None))
        self._pump_handle: asyncio.Handle | None = None
        self._step_threads: list[threading.Thread] = []  # the threads that form, run and answer steps (run())
        self._pump_next_turn = False  # whether _pump_handle runs on the loop's next turn (a step is in flight)
        self._look_for_joins_at = 0.0  # when _pump next looks for landed states to join (time.monotonic())
        self._loop_thread: int | None = None
        for name, value in (("late_after_s", late_after_s), ("form_margin_s", form_margin_s),
                            ("punctual_late_after_s", punctual_late_after_s), ("late_parts_s", late_parts_s)):
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        self.give_up_after_s = give_up_after_s
        self.late_parts_s = late_parts_s
        self.cache_size = cache_size
        self.stats = ClientStats(timeout_s)
        # What the team client said of its play beyond its answers ({code, text}: a lost shard, states reset),
        # each sent to the server once a connection is welcomed (the first `_notices_sent` were).
        self.notices: list[dict] = []
        self._notices_sent = 0
        # With timeline=True: unique_id -> {stage: time.monotonic()} for the stages received, batched,
        # submitted (pipelined steps only), done and answered (the answer queued for sending).
        self.timeline: dict[int, dict[str, float]] | None = {} if timeline else None
        # timeline or step_log: each pipelined step's {formed, submitted, ended (time.monotonic()), rows, symbols,
        # the requests waiting once it was submitted, and (once it ended) those joined to it}, in submission order
        self.steps: list[dict] | None = [] if timeline or step_log else None
        # and each request frame's (received and parsed: time.perf_counter(), its requests' unique ids), where
        # a step's rows came from (scripts/benchmarks/serving.arrival_numbers)
        self.frames: list[tuple[float, list[int]]] | None = [] if timeline or step_log else None
        # timeline, journaled: each state checkpoint's export (began, returned: time.monotonic()), on the thread that
        # submits, just before a submit (scripts/e2e_timeline.py: what the steps after them cost)
        self.exports: list[tuple[float, float]] | None = [] if timeline and journal is not None else None
        self._scheduler = Scheduler()
        # A team client with prefetch(symbols) starts moving states when their requests arrive, and its ready(symbol)
        # holds back a symbol whose state is still on its way while the others step (unless its states never move).
        # One that holds back (a sharded engine's: the symbols of a shard late to answer) is asked only while a step
        # has late parts (_team_ready): a call per waiting symbol and step otherwise.
        moves = team_api.moves_states(team_client)
        self._prefetch = getattr(team_client, "prefetch", None) if moves else None
        self._prefetches: queue.SimpleQueue = queue.SimpleQueue()  # symbols whose requests arrived; None: stop
        self._ready = getattr(team_client, "ready", None) if moves else None
        self._holds_back = getattr(team_client, "ready", None) if team_api.holds_back(team_client) else None
        # One lock guards _scheduler, _steps and the two flags; the submitter (or the single worker)
        # waits on _work_ready, the completer on _steps_ready, so neither takes the other's wake-up.
        lock = threading.Lock()
        self._work_ready = threading.Condition(lock)
        self._steps_ready = threading.Condition(lock)
        self._worker_stopping = False
        # the steps in flight (_Step), oldest first; and those taken off it for late parts (LATE_PARTS_S), with the
        # number of them holding back each symbol (the symbols of their missing parts)
        self._steps: deque = deque()
        self._late: list = []
        self._held: dict[str, int] = {}
        # symbol -> (its request joined to a step, that step's pending, its joined list) until the fate is settled
        self._joining: dict[str, tuple] = {}
        self._refused: tuple = (None, set())  # (a queued step's pending, the symbols it refused to join)
        self._fate_failed: set[int] = set()  # joins whose fate() raised: their step's answer settles them
        self._failures_logged: set[str] = set()  # the steps' failures whose traceback was logged, by their message
        self._errors_logged: set[str] = set()  # reasons for requests not answered that were logged
        # when to form the next pipelined step (under the lock), its step sizes at the team client's step rows
        # (formed late behind steps of late_after_s or more, or of punctual_late_after_s while the host wakes the
        # submitter on time, form_margin_s before the host's time says: StepClock's defaults unless given)
        clock_options = {"late_after_s": late_after_s, "margin_s": form_margin_s,
                         "punctual_late_after_s": punctual_late_after_s}
        self._clock = StepClock(row_sizes=team_api.step_rows(team_client),
                                **{k: v for k, v in clock_options.items() if v is not None})
        self._submitter_done = False
        # the symbol whose state is being exported for the journal's checkpoint (none of its requests joins a step
        # until the copy is done), and the thread that writes the checkpoints (client/journal.py)
        self._checkpointing: str | None = None
        # a symbol a closed segment has waited for while it was in a step at each of CHECKPOINT_MISSES submits: held
        # out of the next step until its steps in flight are answered, then checkpointed (_checkpoint)
        self._draining: str | None = None
        self._checkpoint_misses = 0
        self._checkpoint_writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._checkpoint_job: concurrent.futures.Future | None = None
        self._wake_at: int | None = 0  # waiting symbols from which an arrival notifies the submitter (under the lock)
        # The fields below are touched only on the event loop thread.
        # uid -> what the request held (_request_print): a resent id must hold the same request
        self._in_flight: dict[int, int] = {}  # queued or being computed
        # ids in flight when the current connection began, and those of them answered on it: the server's resend of
        # such an id (its backlog, formed before that answer reached it) crosses the answer and is not answered again
        self._carried: set[int] = set()
        self._crossing: set[int] = set()
        # ids whose predictions went out on no connection, or whose send failed: they wait for the server's resend
        # (answered from the cache), so a stream is not played to its end while any does (_stream_answered); a
        # refusal lost so is refused again on the resend, and the server counts it missed either way
        self._unsent: set[int] = set()
        self._rejected_ids: OrderedDict[int, None] = OrderedDict()  # in the order refused (the last REFUSALS_KEPT)
        self._cache: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()  # uid -> (answer, request print)
        # ids whose answers left the cache, and the refused ids between them: a resend is refused, since stepping it
        # again would advance its symbol's state twice (ranges: ids in order take a few bytes each)
        self._evicted = IdRanges()
        # the refused ids older than _rejected_ids' (in _evicted too): after a reconnect the server resends them with
        # its backlog, the oldest first, and an id answered long ago there is the mark of a new stream (_new_stream)
        self._refused_long_ago = IdBits()
        if replayed:  # (client/journal.py Replayed) answered from the replay, never stepped twice, nor the refused once
            self._evicted, self._refused_long_ago = replayed.older, replayed.refused_long_ago
            self._remember_refusals(replayed.refused)
            for uid, (prediction, symbol, features) in replayed.recent.items():
                self._cache[uid] = prediction, _request_print(symbol, features)
                if len(self._cache) > cache_size:
                    self._evict(self._cache.popitem(last=False)[0])
        if replayed is not None and self._last_use is not None:  # the states replayed are used now
            self._last_use.update(dict.fromkeys(replayed.held, time.monotonic()))
        self._fed_on_connection = False  # a request new to this client came on the current connection
        self._ws = None
        self._unread = None  # the connection ended because a send to it was stuck server_idle_s (_send_frame)
        self._send_tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def run(self) -> dict:
        """Play until the session ends; return the summary, with its outcome (see the class)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # The event loop and the model thread hand the GIL back and forth for every request; with the
        # default 5 ms switch interval a thread that wants it can wait that long, which is latency.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        # A full collection walks every object alive, torch's and the model's: 96 ms on an H100 machine, in the
        # middle of play (bench/LOG.md section 22). Frozen, they are out of the collector's reach.
        gc.collect()
        gc.freeze()
        self._loop_thread = threading.get_ident()
        if not callable(getattr(self.team_client, "submit_batch", None)):
            targets = {"model-step": self._work}
        elif self.inline_steps:
            targets = {}
        else:
            targets = {"model-submit": self._submit_steps, "model-complete": self._complete_steps}
        if callable(self._prefetch):
            targets["prefetch"] = self._prefetch_arrivals
        threads = [threading.Thread(target=target, name=name, daemon=True) for name, target in targets.items()]
        self._step_threads = [thread for thread in threads if thread.name != "prefetch"]
        for thread in threads:
            thread.start()
        try:
            await self._connect_loop()
        finally:
            with self._work_ready:
                self._worker_stopping = True
                self._work_ready.notify_all()
            self._prefetches.put(None)
            for thread in threads:  # the completer still answers every step already submitted
                await asyncio.to_thread(thread.join)
            while self.inline_steps and (self._steps or self._late):  # _pump answers every step submitted
                await asyncio.sleep(READY_POLL_S)
            if self._checkpoint_writer is not None:  # a checkpoint half made is of no use: finished
                await asyncio.to_thread(self._checkpoint_writer.shutdown)
            if self._send_tasks:
                await asyncio.gather(*self._send_tasks, return_exceptions=True)
            gc.unfreeze()
        if self.outcome is None:  # only stop() ends the session without saying how
            self._finish(COMPLETE if self._ended else INTERRUPTED)
            if self.outcome == INTERRUPTED and self._stopped_why:
                self.detail = f"{self._stopped_why}: {self.detail}"
        return self.summary()

    def notice(self, code: str, text: str) -> None:
        """Say what the answers alone do not show (a sharded engine's lost shard, states started again): in the
        summary's notices and to the server as an `error` message with this code. Callable from any thread."""
        self._loop.call_soon_threadsafe(self._on_notice, code, text)

    def summary(self) -> dict:
        """The stats so far, with the outcome (None while playing), the server's model and the notices."""
        welcome = self.welcome or {}
        return {**self.stats.summary(), "outcome": self.outcome, "detail": self.detail, "notices": list(self.notices),
                "total_requests": welcome.get("requests"), "server_preset": welcome.get("preset"),
                "server_weights_fingerprint": welcome.get("weights_fingerprint"),
                "weights_fingerprint": self.weights_fingerprint, "weights_match": self._weights_match()}

    def progress_line(self) -> str:
        """The stats' progress line, with the stream's length once the server has said it."""
        return self.stats.progress_line((self.welcome or {}).get("requests"))

    def _finish(self, outcome: str, detail: str | None = None) -> None:
        """Record how the session ended (the first call wins)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        if detail is None:
            detail = {COMPLETE: f"the stream was played to the end: {self._played()} requests answered in time",
                      INTERRUPTED: f"stopped before the end of the stream: {self._played()} requests answered "
                                   f"in time"}[outcome]
        self.detail = detail

    def _weights_match(self) -> bool | None:
        theirs = (self.welcome or {}).get("weights_fingerprint")
        if theirs is None or self.weights_fingerprint is None:
            return None
        return theirs == self.weights_fingerprint

    def stop(self, why: str | None = None) -> None:
        """End the session (call on the event loop thread); `why` (e.g. "SIGTERM") heads the interrupted detail. No
        step is formed after it; the steps in flight are answered, and their answers sent, before the connection
        closes (within STOP_DRAIN_S); a connection being made is given up."""
        self._stopped_why = why
        if self._stop is None:
            return
        self._stop.set()
        with self._work_ready:
            self._worker_stopping = True
            self._work_ready.notify_all()
        if self._ws is not None:
            self._spawn(self._close(self._ws, drain=True))

    async def _close(self, ws, drain: bool = False) -> None:
        """Close `ws` from this side: with `drain`, once the steps in flight are answered and their answers sent (at
        most STOP_DRAIN_S); a close not done within transport.CLOSE_TIMEOUT_S drops the connection."""
        if drain:
            deadline = time.monotonic() + STOP_DRAIN_S
            while self._steps_running() and time.monotonic() < deadline:
                await asyncio.sleep(READY_POLL_S)
            await asyncio.sleep(0)  # the answers the step threads handed the loop, queued before this turn
            sends = self._send_tasks - {asyncio.current_task()}
            if sends:
                await asyncio.wait(sends, timeout=max(deadline - time.monotonic(), 0.0))
        await transport.close_within(ws)

    def _steps_running(self) -> bool:
        """Whether a step is in flight: submitted and not answered, or being run by the worker thread (a step thread
        ends once it has answered its last step after stop())."""
        return bool(self._steps or self._late) or any(thread.is_alive() for thread in self._step_threads)

    async def _connect_loop(self):
        delay = self.backoff_s
        # The first connection has connect_timeout_s in all, so that a wrong address fails fast; once the
        # client has played, a lost connection is retried (with backoff) for give_up_after_s.
        unreachable_since = time.monotonic()
        while not self._stop.is_set():
            first = self.stats.connections == 0
            window = self.connect_timeout_s if first else self.give_up_after_s
            remaining = window - (time.monotonic() - unreachable_since)
            try:
                if (ws := await self._connect(max(remaining, 0.1))) is None:
                    return  # stopped while connecting
                async with ws:
                    requests_before = self.stats.requests
                    if await self._session(ws):
                        return
                    if self.stats.requests > requests_before:  # it played: back off from the start again
                        delay = self.backoff_s
                    unreachable_since = time.monotonic()
            except transport.ProtocolMismatch as exc:
                self._finish(WRONG_PROTOCOL, str(exc))
                return
            except transport.ConnectError as exc:
                waited = time.monotonic() - unreachable_since
                if waited >= window:
                    reason = str(exc)
                    if first:
                        self._finish(UNREACHABLE, f"cannot reach {self.url} within {waited:.1f} s ({reason})")
                    elif self._stream_answered():  # (a server of one stream that went away as its end was sent)
                        self._finish(COMPLETE, f"every one of the stream's {self.stats.requests:,} requests was "
                                               f"received and answered; the connection was lost before the "
                                               f"server's end, and {self.url} stayed unreachable for {waited:.1f} s "
                                               f"({reason})")
                    else:
                        self._finish(CUT_SHORT, f"the connection was lost after {self._played()} requests "
                                                f"answered and {self.url} stayed unreachable for {waited:.1f} s "
                                                f"({reason})")
                    return
                log.info("connecting to %s failed (%s); retrying in %.2f s", self.url, exc, delay)
            remaining = window - (time.monotonic() - unreachable_since)
            try:
                await asyncio.wait_for(self._stop.wait(), min(delay, max(remaining, 0.0)))
            except TimeoutError:
                pass
            delay = min(delay * 2, self.backoff_max_s)

    async def _connect(self, open_timeout: float):
        """A connection to the server (transport.connect's errors raised), or None where stop() came first: the
        attempt is given up (a server slow to accept was played on, the stop unseen, once it did)."""
        connecting = asyncio.ensure_future(transport.connect(self.url, open_timeout=open_timeout,
                                                             ws_compression=self.ws_compression, tls=self._tls))
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((connecting, stopping), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            connecting.cancel()
            raise
        finally:
            stopping.cancel()
        if connecting.done():
            ws = connecting.result()
        else:
            connecting.cancel()
            try:  # its cleanup (the socket closed) done before going on
                ws = await connecting
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # (run() itself cancelled meanwhile)
                    raise
                return None
            except Exception:  # (it failed as it was given up)
                return None
        if self._stop.is_set():
            await self._close(ws)
            return None
        return ws

    async def _session(self, ws) -> bool:
        """Serve one connection; True when the session is over, False to reconnect."""
        self.stats.connections += 1
        self._welcomed, self._refusal = False, None
        self._fed_on_connection = False
        self._carried, self._crossing = set(self._in_flight), set()
        self._ws = ws
        requests_before = self.stats.requests
        heartbeat = asyncio.create_task(self._heartbeat(ws))
        idle_watch = asyncio.create_task(self._watch_idle(ws))
        try:
            await ws.send(ws.encode(protocol.register(
                self.team, self.token, preset=self.preset, weights_fingerprint=self.weights_fingerprint,
                allow_weights_mismatch=self.allow_weights_mismatch, session_key=self._session_key)))
            async for frame in ws:
                self._frames += 1
                self._on_frame(ws, frame)
        except transport.ConnectionClosed:
            pass
        except transport.ProtocolMismatch as exc:
            # A tcp-json connection that ended before its first line, or began with no JSON, asks the server a
            # websocket handshake to say which protocol it speaks. One that spoke this protocol earlier in the
            # session only dropped this connection: this project's server speaks both on one port, and its answer
            # to the handshake ended such sessions as wrong_protocol. So did a first connection that dropped before
            # its first line (a reset, a line cut short): an answer not certain is said once give_up_repeats
            # connections end so, as a server that breaks every connection the same way is given up.
            self._unsure_mismatches += not exc.certain
            if not self._frames and (exc.certain or self._unsure_mismatches >= self.give_up_repeats):
                raise
        finally:
            heartbeat.cancel()
            idle_watch.cancel()
            self._ws = None
        if self.stats.requests > requests_before:
            self._failures.clear()
        if self.outcome is not None or self._stop.is_set() or self._ended:
            return True
        code, reason = ws.close_code, ws.close_reason
        if code in _REFUSED_CLOSE_CODES:
            refusal = self._refusal or {"error": reason or f"close code {code}", "details": ""}
            said = refusal["error"] + (f": {refusal['details']}" if refusal["details"] else "")
            if refusal["error"] == "weights_mismatch":
                self._finish(WEIGHTS_MISMATCH, refusal["details"])
            else:
                self._finish(REFUSED, f"the server refused this client ({said})")
            return True
        if code == 1000:
            self._finish(CUT_SHORT, f"the server closed the session ({code} {reason or 'normal closure'}) "
                                    f"before the end of the stream, after {self._played()} requests answered")
            return True
        if self._unread is ws:
            how = ("unread",), (f"the server read nothing for {self.server_idle_s:g} s: an answer waited that long "
                                f"to be sent")
        else:
            how = _how_it_ended(ws, self._refusal)
        if self._gave_up(*how):
            return True
        log.warning("connection lost (%s); reconnecting, states kept", how[1])
        return False

    def _gave_up(self, way, said) -> bool:
        """Note how a connection ended; True (the session over, GAVE_UP) when the last give_up_repeats connections
        all ended that way with no new request in between."""
        self._failures.append(way)
        if len(self._failures) < self.give_up_repeats or len(set(self._failures)) > 1:
            return False
        self._finish(GAVE_UP, f"the server failed the same way on {self.give_up_repeats} connections in a row, "
                              f"with no new request between them: {said}; giving up after {self._played()} "
                              f"requests answered")
        return True

    async def _watch_idle(self, ws):
        """Cut the session short when the server sends nothing, not even a heartbeat, for server_idle_s, or nothing
        that answers the register (heartbeats only) as long."""
        connected = self._last_request_at = time.monotonic()
        while True:
            if self._stream_stopped(ws):
                return
            frames, since = self._frames, time.monotonic()
            while self._frames == frames:
                idle = time.monotonic() - since
                if idle >= self.server_idle_s:
                    if self._stream_stopped(ws) or self._refused_open(ws):  # (an event-style server may fall silent
                        return                                              # at its stream's end)
                    self._finish(CUT_SHORT, f"the server sent nothing for {idle:.1f} s (not even a heartbeat) and "
                                            f"never said the stream was over, after {self._played()} requests "
                                            f"answered (the limit: --server-idle-s {self.server_idle_s:g})")
                    ws.abort()  # a server this quiet would not answer a close either
                    return
                await asyncio.sleep(min(self.server_idle_s - idle, max(self.server_idle_s / 10, 0.05)))
            unanswered = time.monotonic() - connected
            if not self._welcomed and unanswered >= self.server_idle_s and self._refused_open(ws):
                return
            if not self._welcomed and self._refusal is None and unanswered >= self.server_idle_s:
                self._finish(CUT_SHORT, f"the server never answered the register (no welcome, no refusal, no "
                                        f"request) in {unanswered:.1f} s, after {self._played()} requests answered "
                                        f"(the limit: --server-idle-s {self.server_idle_s:g})")
                ws.abort()
                return

    def _refused_open(self, ws) -> bool:
        """Whether the server refused the register for a limit that passes and left the connection open (it closes it,
        1013: trying again later may help) for server_idle_s: the connection is dropped, and the connect loop tries
        again, and gives up when it keeps coming (a server that heartbeat on after such a refusal held the client for
        good, neither welcomed nor refused)."""
        if self._welcomed or self._refusal is None or self._refusal["error"] not in protocol.REFUSALS_THAT_PASS:
            return False
        log.info("the server refused the register (%s) and left the connection open for %g s; dropping it",
                 self._refusal["error"], self.server_idle_s)
        ws.abort()
        return True

    def _stream_stopped(self, ws) -> bool:
        """The original protocol has no end: the event's server stops sending requests and keeps the connection open
        (its heartbeats on, or silent), and the session went on for ever (or was cut short as silent). Once it sent no
        request for server_idle_s, every one answered, the stream is over (the server's `end`)."""
        quiet = time.monotonic() - self._last_request_at
        if (not isinstance(ws, transport.TcpJsonConnection) or self._ended or not self.stats.requests
                or self._in_flight or quiet < self.server_idle_s):
            return False
        self._ended = True
        if self.leave_at_end:
            self._finish(COMPLETE, f"the server sent no request for {quiet:.1f} s, every one answered, and the "
                                   f"original protocol says no end: the stream was played to the end, {self._played()} "
                                   f"requests answered in time (the limit: --server-idle-s {self.server_idle_s:g})")
            self._spawn(self._close(ws))
        return True

    def _stream_answered(self) -> bool:
        """Whether this client received as many requests as the welcome said the stream holds, and none waits for
        its answer or for a connection to send it on: the stream played to its end, though no `end` came."""
        total = (self.welcome or {}).get("requests")
        return total is not None and self.stats.requests >= total > 0 and not self._in_flight and not self._unsent

    def _played(self) -> str:
        """How many requests were answered in time, of how many (when the server said)."""
        total = (self.welcome or {}).get("requests")
        return f"{self.stats.scored:,} of {total:,}" if total is not None else f"{self.stats.scored:,}"

    async def _heartbeat(self, ws):
        try:
            while True:
                await asyncio.sleep(self.heartbeat_s)
                await ws.send(ws.encode(protocol.heartbeat(time.time())))
        except transport.ConnectionClosed:
            pass

    # ---- receiving (event loop thread) -----------------------------------------------------------
    def _on_frame(self, ws, frame):
        try:
            msg = ws.decode(frame)
            kind = msg["type"]
            if kind == "inference_request":
                self._last_request_at = time.monotonic()
                self._welcomed = True  # the register was accepted, whatever became of the welcome (a malformed one)
                self._on_request(ws, msg)
            elif kind == "score_update":
                self.stats.add_scores(msg)
            elif kind == "error":
                if not self._welcomed:  # the answer to register: a refusal
                    self._on_refusal(ws, msg)
                else:  # the original protocol's details may be null: no empty ": " then
                    log.warning("server error %s", msg["error"] + (f": {msg['details']}" if msg["details"] else ""))
            elif kind == "welcome":
                self._on_welcome(ws, msg)
            elif kind == "end":
                self._ended = True
                if self.leave_at_end:
                    self._finish(COMPLETE)
                    self._spawn(self._close(ws))
            elif kind != "heartbeat":
                raise protocol.ProtocolError(f"unexpected {kind} message: a server does not send those")
        except protocol.ProtocolError as exc:
            why = str(exc)
            if exc.unique_ids is not None:  # a malformed request, in either protocol
                why += f"; unique_ids {self._refuse_malformed(exc.unique_ids)} not answered"
            log.warning("bad message from server: %s", why)
            self._send(ws, protocol.error("bad_message", why))

    def _new_stream(self, ws, uid, symbol):
        """After a reconnect, before any request new to this client, the server sent a unique_id that held another
        request before, or one answered so long ago that its answer left the cache (a resume resends what was
        unanswered when the connection broke): it began another stream (restarted, or a new round), whose ids
        start over. Over the original protocol nothing else can tell (no session, no welcome). The states here are
        the old stream's: the session ends, rather than answer the new stream from them or refuse its every
        reused id."""
        log.warning("request %d (%s) after the reconnect reuses the unique_id of an earlier request: the server "
                    "began another stream", uid, symbol)
        self._finish(NEW_STREAM, f"after the reconnect the server sent unique_id {uid} ({symbol}), which held another "
                                 f"request before or was answered long ago: it began another stream (restarted, or a "
                                 f"new round), and this client's states are the old one's; {self._played()} requests "
                                 f"of the old stream answered in time")
        self._spawn(self._close(ws))

    def _on_refusal(self, ws, msg):
        """The server refused register: said at once, unless it is a limit that passes (rate, connections, room),
        which the connect loop tries again (and gives up on when it keeps coming)."""
        self._refusal = msg
        log.info("server error %s: %s", msg["error"], msg["details"])
        if msg["error"] in protocol.REFUSALS_THAT_PASS:
            return
        if msg["error"] == "weights_mismatch":
            self._finish(WEIGHTS_MISMATCH, msg["details"])
        else:
            said = msg["error"] + (f": {msg['details']}" if msg["details"] else "")
            self._finish(REFUSED, f"the server refused this client ({said})")
        self._spawn(self._close(ws))

    def _on_welcome(self, ws, msg):
        first = self.welcome is None
        self._session_key = msg.get("session_key", self._session_key)
        self.welcome, self._welcomed = msg, True
        if first and self.journal is not None:
            if self._replayed and msg.get("session_key") != self.journal.session_key:
                # the states replayed are another session's: the session ends, as for a new stream, and the team
                # client plays this one from fresh states
                self._finish(NEW_STREAM, f"the server's session is not the journal's ({self.journal.path}): the "
                                         f"states replayed from it are not this session's")
                self._spawn(self._close(ws))
                return
            self.journal.begin(msg.get("session_key"))
        if "timeout_s" in msg:  # the server's own (its --timeout-s): else answers it scored in time count as missed
            self.stats.timeout_ms = msg["timeout_s"] * 1000.0
        if first and self.on_welcome is not None:
            self.on_welcome(msg)
        self._send_notices()

    def _on_notice(self, code, text):
        self.notices.append({"code": code, "text": text})
        self._send_notices()

    def _send_notices(self):
        if self._ws is None or not self._welcomed:
            return  # sent once a connection is welcomed
        for notice in self.notices[self._notices_sent:]:
            self._send(self._ws, protocol.error(notice["code"], notice["text"]))
        self._notices_sent = len(self.notices)

    def _refuse_malformed(self, ids) -> list[int]:
        """Count the ids of a malformed request new to this client as requests received and answered with an error,
        as a NaN row is (a resend of one is refused too, rather than stepped after its symbol's later requests):
        errors never outnumber requests. Returns those ids."""
        refused = [uid for uid in dict.fromkeys(ids) if self._unseen(uid)]
        for uid in refused:
            self.stats.note_request(uid)
        self._reject(refused)
        return refused

    def _on_request(self, ws, msg):
        if self.outcome is not None:  # the session has ended (a new stream's, say): its states step nothing more
            return
        # (decoded by the connection, which validated it) a ProtocolError names its ids (_on_frame)
        ids, symbols, features = protocol.parse_inference_request(msg, validated=True)
        finite_rows = np.isfinite(features).all(axis=1).tolist()
        cached_ids, new_requests = [], []
        received_at = time.perf_counter()
        for index, (uid, symbol, row, finite) in enumerate(zip(ids, symbols, features, finite_rows)):
            if finite and uid not in self._in_flight and uid not in self._cache and uid not in self._crossing \
                    and uid not in self._rejected_ids and uid not in self._evicted:  # a new request: most are
                self._in_flight[uid] = _request_print(symbol, row)
                self.stats.note_request(uid)
                new_requests.append(Request(uid, symbol, row, received_at))
                self._fed_on_connection = True
                continue
            known = self._cache[uid][1] if uid in self._cache else self._in_flight.get(uid)
            if known is not None and known != _request_print(symbol, row):
                if self.stats.connections > 1 and not self._fed_on_connection:
                    self._new_stream(ws, uid, symbol)
                    return
                log.warning("request %d (%s) reuses the unique_id of another request; not answered", uid, symbol)
                self._send(ws, protocol.error("bad_request", f"unique_id {uid} (symbol {symbol}): received before "
                                                             f"for another symbol or other features; a resend must "
                                                             f"repeat its request; not fed to the model"))
            elif uid in self._crossing:  # answered on this connection already (its answer cached or not since)
                self._crossing.discard(uid)
            elif uid in self._cache:
                cached_ids.append(uid)
            elif uid in self._in_flight:
                continue  # resent while still queued or computing: answered when its step is done
            elif uid in self._rejected_ids or uid in self._refused_long_ago:  # (before _evicted, which takes them in)
                self._refuse_request(ws, uid, symbol, "rejected earlier")
            elif uid in self._evicted:
                if self.stats.connections > 1 and not self._fed_on_connection:  # no resume resends that far back
                    self._new_stream(ws, uid, symbol)
                    return
                log.warning("request %d (%s) was answered earlier and its answer left the cache; not fed to the "
                            "model again", uid, symbol)
                self._send(ws, protocol.error("bad_request", f"unique_id {uid} (symbol {symbol}): answered earlier, "
                                                             f"its answer no longer cached (the last {self.cache_size} "
                                                             f"are); not fed to the model again"))
            else:  # new, and not finite (a new finite one went in above)
                self.stats.note_request(uid)
                self._reject([uid])
                self._refuse_request(ws, uid, symbol, f"features are not {NUM_FEATURES} numbers"
                                     if index in msg.get("unreadable_rows", ()) else "features contain NaN or inf")
        self._mark("received", (r.unique_id for r in new_requests))
        if self.frames is not None:
            self.frames.append((received_at, ids))
        if new_requests:
            queued = []
            with self._work_ready:
                if self._last_use is not None:
                    self._used(request.symbol for request in new_requests)
                for request in new_requests:
                    if not self._join(request):
                        self._scheduler.push(request)
                        queued.append(request.symbol)
                if self._wake_at is not None and self._scheduler.waiting_symbols() >= self._wake_at:
                    self._work_ready.notify()
            # after the joins, which the prefetch thread would hold up (the table's lock, the GIL) just as the
            # step they join may start; a joined symbol is on the GPU already
            if queued and callable(self._prefetch):
                self._prefetches.put(queued)
            # at once where nothing is in flight; else on the loop's next turn, as it is already: with a pump after
            # every frame the loop fell behind past 16,000 req/s (bench/LOG.md section 79)
            if self.inline_steps and not self._pump_next_turn:
                self._pump()
        if cached_ids:
            self.stats.resent_from_cache += len(cached_ids)
            predictions = np.stack([self._cache[uid][0] for uid in cached_ids])
            self._send(ws, protocol.inference_response(cached_ids, predictions, time.time()), cached_ids)

    def _refuse_request(self, ws, uid, symbol, reason):
        # a feed's NaN rows, and each reconnect's resend of every request refused before (all of a lost shard's
        # symbols' since), were a line each on stderr: each reason is logged once, the server told of every one
        if reason not in self._errors_logged and len(self._errors_logged) < MAX_ERRORS_LOGGED:
            self._errors_logged.add(reason)
            log.warning("request %d (%s): %s; not fed to the model (later requests refused so are not logged)",
                        uid, symbol, reason)
        self._send(ws, protocol.error("bad_request", f"unique_id {uid} (symbol {symbol}): {reason}; "
                                                     f"not fed to the model"))

    def _unseen(self, uid) -> bool:
        """Whether unique_id `uid` is new to this client: not queued, computing, answered or refused."""
        return not (uid in self._in_flight or uid in self._cache or uid in self._evicted or uid in self._rejected_ids)

    # ---- prefetch (its own thread) --------------------------------------------------------------
    def _prefetch_arrivals(self):
        """Tell the team client of arrived requests' symbols, everything queued since its last call at once (each
        symbol once, in arrival order), until the runtime stops."""
        while (symbols := self._prefetches.get()) is not None:
            stopping = False
            while not self._prefetches.empty():
                more = self._prefetches.get()
                if more is None:
                    stopping = True
                    break
                symbols += more
            try:
                self._prefetch(list(dict.fromkeys(symbols)))
            except Exception:  # a failing team client must not kill the runtime: the steps place the states
                log.exception("team client's prefetch failed")
            if stopping:
                return

    @property
    def late_wakes(self) -> int:
        """How many of the submitter's timed waits to form a step late ended late (StepClock.late_wakes)."""
        return self._clock.late_wakes

    @property
    def latest_wake_s(self) -> float:
        """The latest any of those waits ended, in seconds after it was due (StepClock.latest_wake_s)."""
        return self._clock.latest_wake_s

    # ---- model steps (worker threads) ------------------------------------------------------------
    def _work(self):
        while (taken := self._take_batch(lambda: 0.0 if len(self._scheduler) else None)) is not None:
            batch, _ = taken
            self._forget_idle(batch)
            try:
                ids, predictions, errors, restarted = check_answer(
                    self.team_client.process_batch(team_api.batch_for(self.team_client, batch)),
                    [r.unique_id for r in batch])
            except Exception as exc:  # a failing team client must not kill the runtime
                self._fail(batch, exc, "process_batch")
                continue
            self._answer(ids, predictions, errors, batch, restarted)
            if self.journal is not None and self.journal.checkpoint_due():  # (no step in flight)
                self._checkpoint()

    def _submit_steps(self):
        try:
            while (taken := self._take_batch(self._submit_in)) is not None:
                self._submit(*taken)
        finally:
            with self._steps_ready:
                self._submitter_done = True
                self._steps_ready.notify()

    def _submit(self, batch, formed_at):
        """Submit one step of `batch`, whose forming began at `formed_at` (time.monotonic()), to the team client and
        queue it for its answer."""
        if self.journal is not None and (self._draining is not None or self.journal.checkpoint_due()):
            self._checkpoint()
        self._forget_idle(batch)
        try:
            pending = self.team_client.submit_batch(team_api.batch_for(self.team_client, batch))
        except Exception as exc:  # a failing team client must not kill the runtime
            self._fail(batch, exc, "submit_batch")
            return
        submitted_at = time.monotonic()
        self._mark("submitted", (r.unique_id for r in batch))
        symbols = len({r.symbol for r in batch})
        size = self._clock.size(len(batch), symbols)
        with self._steps_ready:
            record = None
            if self.steps is not None:
                record = {"formed": formed_at, "submitted": submitted_at, "ended": None,
                          "rows": len(batch), "symbols": symbols, "waiting": len(self._scheduler)}
                self.steps.append(record)
            self._clock.submitted(formed_at, submitted_at)
            self._steps.append(_Step(batch, pending, submitted_at, size, record))
            self._steps_ready.notify()

    def _used(self, symbols):
        """These symbols' requests came or step now (holding the lock)."""
        now = time.monotonic()
        for symbol in symbols:
            self._last_use[symbol] = now
            self._last_use.move_to_end(symbol)

    def _forget_idle(self, batch):
        """With idle_timeout_s, before `batch` steps: the team client forgets the symbols none of whose requests came
        or stepped for that long, and none of which is queued, in a step or being checkpointed; the journal says so
        after their requests answered (a step is in flight until answered and journaled) and before their next.
        Under the lock: none of their requests joins a step meanwhile, to be journaled after it as if afresh."""
        if self._last_use is None:
            return
        with self._work_ready:
            self._used(request.symbol for request in batch)
            now, idle = time.monotonic(), []
            for symbol, used in self._last_use.items():
                if now - used <= self.idle_timeout_s:
                    break
                if not (self._scheduler.has(symbol) or self._in_a_step(symbol) or symbol == self._checkpointing):
                    idle.append(symbol)
            if not idle:
                return
            try:
                self.team_client.release(idle)
            except Exception:  # a failing team client must not kill the runtime: it forgets nothing more
                log.exception("the team client's release() failed; idle symbols are no longer forgotten")
                self._last_use = None
                return
            for symbol in idle:
                del self._last_use[symbol]
            self.forgotten_idle += len(idle)
            if self.journal is not None:
                self.journal.forget(idle)

    # ---- the journal's state checkpoints (client/journal.py) ------------------------------------------------
    def _checkpoint(self):
        """Export the state of a symbol that a closed segment of the journal waits for and none of whose requests
        is in a step, or let covered segments go, in the checkpoint thread, one at a time. Called by the thread that
        submits the steps, before a submit: the export follows the steps submitted and comes before the next; and
        none of the symbol's requests joins a step until its copy is done (a join enters a step submitted before).
        Where every symbol waited for was in a step at CHECKPOINT_MISSES submits in a row (near the max rate each
        has requests in every step), the oldest is held out of steps until those in flight are answered (~a step
        later for its requests, once a segment)."""
        if not self.journal.checkpoint_due():  # (checkpoints stopped, or the segment went another way)
            self._draining = None
            return
        if self._checkpoint_job is not None and not self._checkpoint_job.done():
            return
        with self._work_ready:
            busy = set(self._joining) | set(self._held)
            for step in (*self._steps, *self._late):
                busy.update(r.symbol for r in step.batch)
                busy.update(r.symbol for r in step.joined)
            due = self.journal.begin_checkpoint(busy)
            if due is not None:  # (another symbol free first: the one held out goes back, its misses counted anew)
                self._checkpointing, self._checkpoint_misses, self._draining = due[0], 0, None
            elif (waiting := self.journal.checkpoint_waiting()) is not None and self._draining is None:
                self._checkpoint_misses += 1
                if self._checkpoint_misses >= CHECKPOINT_MISSES:
                    self._draining = waiting
        if self._checkpoint_writer is None:
            self._checkpoint_writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        if due is None:
            if self.journal.droppable():
                self._checkpoint_job = self._checkpoint_writer.submit(self.journal.drop_covered)
            return
        symbol, covers = due
        began = time.monotonic()
        try:
            pending = self.team_client.export_state(symbol)
        except Exception as exc:  # a failing team client must not kill the runtime: its records are kept
            with self._work_ready:
                self._checkpointing = None
            self.journal.end_checkpoint(symbol, covers, failed=f"export_state raised {type(exc).__name__}: {exc}")
            return
        if self.exports is not None:
            self.exports.append((began, time.monotonic()))
        self._checkpoint_job = self._checkpoint_writer.submit(self._write_checkpoint, symbol, covers, pending)

    def _in_a_step(self, symbol) -> bool:
        """Whether a request of `symbol` is in a step in flight, joined to one, or held back (holding the lock)."""
        return symbol in self._joining or symbol in self._held or any(
            r.symbol == symbol for step in (*self._steps, *self._late) for r in (*step.batch, *step.joined))

    def _write_checkpoint(self, symbol, covers, pending):
        """(The checkpoint thread) wait for the state's copy, let the symbol join steps again, write it."""
        try:
            state, failed = pending.result(), None
        except Exception as exc:
            state, failed = None, f"its export failed ({type(exc).__name__}: {exc})"
        with self._work_ready:
            self._checkpointing = None
        self.journal.end_checkpoint(symbol, covers, state, failed)

    # ---- inline steps (the event loop thread) ------------------------------------------------------
    def _pump(self):
        """With inline_steps, the submitter's and the completer's work on the event loop: answer the steps in flight
        that have ended, oldest first, then submit the next step if it is due and the pipeline has room (one a turn:
        the frames that came during a submit are read before the next step is formed); then look again: on the
        loop's next turn while a step is in flight (nothing wakes the loop when it ends), after the delay the step
        clock asks to form the next step, or every READY_POLL_S while the waiting symbols' states are on their way.
        A step whose pending has no done() counts as ended: its result() then waits on the loop. A step answered in
        parts whose last parts are late leaves the pipeline (_go_on_without), and is looked at every LATE_POLL_S.
        A failure of the pump's own (the team client's are caught where it is called) is logged, the first time with
        its traceback, and the pump looks again after LATE_POLL_S: it was not scheduled again, and a session whose
        last frame had come waited for ever (a journal's failed write did so, bench/LOG.md section 79)."""
        if self._pump_handle is not None:
            self._pump_handle.cancel()
            self._pump_handle, self._pump_next_turn = None, False
        try:
            again = self._pump_work()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            first = why not in self._failures_logged and len(self._failures_logged) < MAX_FAILURES_LOGGED
            if first:
                self._failures_logged.add(why)
            log.error("the runtime's step pump failed%s; looking again in %g s", "" if first else f": {why}",
                      LATE_POLL_S, exc_info=exc if first else None)
            self._pump_handle = self._loop.call_later(LATE_POLL_S, self._pump)
            return
        if self._steps:
            self._pump_handle, self._pump_next_turn = self._loop.call_soon(self._pump), True
        elif again is not None:
            self._pump_handle = self._loop.call_later(again, self._pump)

    def _pump_work(self) -> float | None:
        """The pump's work (_pump); the seconds until it should look again with no step in flight (None: when a
        frame or a release says)."""
        while self._steps and _ended(self._steps[0].pending):
            self._retire(self._steps[0])
        if self._steps and self._parts_late(self._steps[0]):
            self._go_on_without()
        if self._late:  # not a call and a list at each of the loop's turns while a step is in flight
            self._look_at_late_steps()
        again = None
        if not self._worker_stopping:
            with self._work_ready:
                formed_at = time.monotonic()  # the step clock's lead counts forming the step (_next_batch) too
                if (delay := self._submit_in()) != 0:
                    if delay is None and len(self._scheduler) and time.monotonic() >= self._look_for_joins_at:
                        # a state that landed joins the step queued behind the one in flight (looked for every
                        # READY_POLL_S, not on every turn: it asks the team client whether each waiting state is ready)
                        self._look_for_joins_at = time.monotonic() + READY_POLL_S
                        self._join_waiting()
                    batch, again = None, delay
                elif not (batch := self._next_batch()):  # every waiting symbol's state is still on its way
                    again = None if self._only_held_wait() else self._ready_poll_s()  # (held: a release notifies)
            if batch:
                self._mark("batched", (r.unique_id for r in batch))
                self._submit(batch, formed_at)
                again = 0.0  # what waits goes in the next step, even where this one's submit failed
        if self._late:
            again = LATE_POLL_S if again is None else min(again, LATE_POLL_S)
        return again

    def _take_batch(self, due_in):
        """(the next step's requests, marked batched; when forming it began) once due_in() (called under the lock:
        seconds until the step is due, None until a notify) says 0; None when the runtime stops. While every
        waiting symbol's state is still on its way, it waits and asks again."""
        with self._work_ready:
            while True:
                while not self._worker_stopping and (delay := due_in()) != 0:
                    # with the pipeline full (as right after a submit): join what arrived meanwhile, or landed
                    if delay is None and self._join_waiting():
                        self._wake_at = None  # it looks again soon anyway: a state on its way may land and join
                        self._work_ready.wait(READY_POLL_S)
                        continue
                    self._wake_at = self._arrivals_wake_at(delay)
                    due = None if delay is None else time.monotonic() + delay
                    if not self._work_ready.wait(delay) and due is not None:  # timed out: how late it woke
                        self._clock.woke(time.monotonic() - due)
                if self._worker_stopping:
                    return None
                formed_at = time.monotonic()  # the step clock's lead counts forming the step too
                batch = self._next_batch()
                if batch:
                    break
                self._wake_at = 0  # any arrival may be a symbol that is ready
                self._work_ready.wait(None if self._only_held_wait() else self._ready_poll_s())  # a release notifies
        self._mark("batched", (r.unique_id for r in batch))
        return batch, formed_at

    def _arrivals_wake_at(self, delay):
        """From how many waiting symbols an arrival wakes the submitter about to wait `delay` (due_in's answer;
        called holding the lock): any arrival while it waits for work, none while the pipeline is full (a step's
        end wakes it), and while it waits to form the next step late, only one that could fill that step
        (Scheduler.fills needs max_batch symbols waiting); with a full pipeline whose queued step a state on its
        way may still join, any arrival. Each wake-up costs the submitter and the event loop
        the GIL's handoff: at 12,000 requests a second the loop's frames would wake it ~7,000 times a second."""
        if delay is None:
            if len(self._steps) < PIPELINE_DEPTH:
                return 0
            return 1 if self._states_may_join() else None  # its state may be on its way: _take_batch looks
        return self._full_step

    def _only_held_wait(self) -> bool:
        """Whether every waiting symbol is held back by a late step (called holding the lock): none can step until
        one is released (_hold notifies), for as long as a hung shard hangs; looking every READY_POLL_S meanwhile
        went over every waiting symbol ~2,000 times a second."""
        return bool(self._held) and sum(map(self._scheduler.has, self._held)) >= self._scheduler.waiting_symbols()

    def _ready_poll_s(self) -> float:
        """How often to look again while no waiting symbol is ready (called holding the lock): READY_POLL_S for a
        state on its way; LATE_POLL_S while a step has late parts, whose shard's symbols the team client holds back
        until it answers (a sharded engine's ready()), for as long as it hangs."""
        return LATE_POLL_S if self._late else READY_POLL_S

    def _next_batch(self):
        """The next step's requests (called holding the lock)."""
        self._settle_joins()
        return self._scheduler.next_batch(self.max_batch, self.max_per_symbol, self._readiness(),
                                          self._clock.rows_to_take)

    def _join(self, request) -> bool:
        """Join a request to the step queued on the GPU behind the one in flight, if the team client's pending step
        takes it and nothing of its symbol waits before it (called holding the lock): it is then answered with that
        step instead of the one after. `request` is an arrival, or one taken from the front of its queue."""
        if not self._queued_step_joinable() or self._scheduler.has(request.symbol) or request.symbol in self._joining \
                or request.symbol in self._held \
                or request.symbol in (self._checkpointing, self._draining):  # (_checkpoint)
            return False
        pending, joined = self._steps[-1].pending, self._steps[-1].joined
        try:
            if not pending.join(request.unique_id, request.symbol, request.features):
                return False
        except Exception:  # a failing team client must not lose the request: it waits for a step as usual
            log.exception("team client's join of unique_id %d failed; queued instead", request.unique_id)
            return False
        if request.seq < 0:  # an arrival: numbered in the arrival order (a queued one keeps its number)
            self._scheduler.stamp(request)
        joined.append(request)
        self._joining[request.symbol] = (request, pending, joined)
        self._mark("batched", [request.unique_id])
        self._mark("submitted", [request.unique_id])
        return True

    def _queued_step_joinable(self) -> bool:
        """Whether the pipeline is full and its queued step takes joins (called holding the lock)."""
        return (self.join_queued and len(self._steps) >= PIPELINE_DEPTH
                and getattr(self._steps[-1].pending, "join", None) is not None)

    def _states_may_join(self) -> bool:
        """Whether, besides, the team client's states move: a state on its way to the GPU may land before the queued
        step starts, and its request then join it (called holding the lock)."""
        return callable(self._ready) and self._queued_step_joinable()

    def _join_waiting(self) -> bool:
        """Join queued requests to the step queued behind the one in flight, oldest first (called holding the lock):
        those that arrived while the submitter was submitting that step (they found no step to join, then a full
        pipeline: in the swap section 74 of the 80 slowest hot requests, waiting a step more than the rest,
        bench/LOG.md section 59), and those whose state has reached the GPU since they arrived. Only a symbol's one
        queued request (its later ones must follow it), of a symbol not in that step already; a symbol the step
        refused is not offered to it again. True while such a request waits for a state still on its way: only its
        landing (no notify) can let it join, so the submitter looks again every READY_POLL_S."""
        if not self._queued_step_joinable():
            return False
        batch, pending, joined = self._steps[-1].batch, self._steps[-1].pending, self._steps[-1].joined
        if self._refused[0] is not pending:
            self._refused = (pending, set())
        ready = self._readiness()
        singles = self._scheduler.singles()
        # every such request at once, oldest first, looking only at the symbols with one queued request that were
        # not offered yet (a set difference): popping every waiting head took 0.5 ms a look at 1,000 waiting symbols
        offered = singles.keys() - self._refused[1]
        offered.difference_update([r.symbol for r in batch], [r.symbol for r in joined], self._held)
        awaiting = False
        for symbol in sorted(offered, key=singles.__getitem__):
            if ready is not None and not ready(symbol):
                awaiting = awaiting or symbol not in self._joining
                continue
            request = self._scheduler.take_front(symbol)
            if not self._join(request):  # no room left, the step started, or the state not on the GPU yet
                self._scheduler.requeue(request)
                self._refused[1].add(symbol)
        return awaiting

    def _settle_joins(self, done=None, answered=()):
        """Settle each join whose step has read its inputs, and every join of the step `done`, which made it if its
        answer names it (`answered`: the unique ids answered or named under errors); called holding the lock. One
        that made it is answered with its step, one that did not goes back to the front of its symbol's queue."""
        for symbol, (request, pending, joined) in list(self._joining.items()):
            if pending is done:
                fate = request.unique_id in answered
            elif request.unique_id in self._fate_failed:
                continue  # its step's answer settles it
            else:
                try:
                    fate = pending.fate(request.unique_id)
                except Exception:  # a failing team client must not kill the runtime
                    log.exception("team client's fate(%d) failed; settled by its step's answer", request.unique_id)
                    self._fate_failed.add(request.unique_id)
                    continue
                if fate is None:
                    continue
            self._fate_failed.discard(request.unique_id)
            del self._joining[symbol]
            if fate:
                self.joins["taken"] += 1
            else:
                joined.remove(request)
                self.joins["missed"] += 1
                self._scheduler.requeue(request)
                self._work_ready.notify()

    def _readiness(self):
        """The scheduler's test of whether a waiting symbol may step (None: every one may); called holding the
        lock."""
        return self._is_ready if self._team_ready() or self._joining or self._held or self._draining else None

    def _team_ready(self):
        """The team client's ready() to ask, or None (called holding the lock): always where its states move; where
        it holds back, while a step has late parts."""
        if callable(self._ready):
            return self._ready
        return self._holds_back if self._late and callable(self._holds_back) else None

    def _is_ready(self, symbol) -> bool:
        if symbol == self._draining and self._in_a_step(symbol):
            return False  # held out of steps until its state is checkpointed (_checkpoint)
        if symbol in self._joining:
            return False  # its joined request's fate decides what goes first
        if symbol in self._held:
            return False  # its request in a step with late parts goes first
        ready = self._team_ready()
        if ready is None:
            return True
        try:
            return bool(ready(symbol))
        except Exception:  # a failing team client must not hold a symbol back for good
            log.exception("team client's ready(%r) failed; stepping it", symbol)
            return True

    def _submit_in(self) -> float | None:
        """Seconds until the submitter should form the next batch, 0 for now, None while only a notify can change
        that: nothing waits, the pipeline is full, or too few symbols wait to form one before the GPU is free
        (called holding the lock)."""
        if not len(self._scheduler) or len(self._steps) >= PIPELINE_DEPTH:
            return None
        if not self._steps:
            return 0.0
        if self._scheduler.waiting_symbols() < self.pipeline_min_batch:
            return None
        if not self.form_late or self._scheduler.fills(self._full_step, self.max_per_symbol):
            return 0.0  # a step already full gains nothing by waiting for the one in flight to end
        return self._clock.form_in(self._steps[0].size, self._steps[0].submitted_at)

    def _complete_steps(self):
        while True:
            with self._steps_ready:
                self._steps_ready.wait_for(lambda: self._steps or self._late or self._submitter_done)
                if not self._steps and not self._late:
                    return  # the submitter has stopped and every step it submitted is answered
                step = self._steps[0] if self._steps else None
            self._look_at_late_steps()
            if step is None:
                with self._steps_ready:
                    self._steps_ready.wait(LATE_POLL_S)  # for a late step's parts, or a new step
            elif not step.in_parts:
                self._retire(step)
            else:  # waited for up to when its parts are late (then looked at with the late ones)
                wait_s = step.submitted_at + self.late_parts_s - time.monotonic()
                if _waited(step.pending, max(0.0, min(wait_s, LATE_POLL_S) if self._late else wait_s)):
                    if self._late and self._behind_late(step):
                        self._go_on_without()  # its symbols' answers follow their late ones (_look_at_late_steps)
                    else:
                        self._retire(step)
                elif self._parts_late(step):
                    self._go_on_without()

    def _behind_late(self, step) -> bool:
        """Whether a late step misses a part of a symbol of `step` once the late steps are looked at again: `step`
        (ended) may have been formed as the one ahead went late, and a symbol's parts come in order (a shard's), so
        its earlier one may have come with it since the last look, to be answered first."""
        self._look_at_late_steps()
        with self._work_ready:
            return any(r.symbol in self._held for r in step.batch)

    def _parts_late(self, step) -> bool:
        """Whether `step` answers in parts and its last ones are late (LATE_PARTS_S after it was submitted)."""
        return step.in_parts and time.monotonic() - step.submitted_at > self.late_parts_s

    def _go_on_without(self):
        """The pipeline's oldest step has late parts (a hung shard): take it and the steps behind it that answer in
        parts off the pipeline (theirs on that shard are as late; a part of theirs to come soon is answered within
        LATE_POLL_S), so that the next steps form without waiting for them, and answer what has come of them; the
        symbols of their missing parts are held back (their later requests follow them) until their parts come
        (_take_parts) or their step ends (_retire)."""
        with self._work_ready:
            while self._steps and self._steps[0].in_parts:
                step = self._steps.popleft()
                self._late.append(step)
                # before the next step can form; a joined request's symbol too: once its join is settled as taken
                # nothing else holds that symbol back while its request waits for its part
                self._hold(step, {r.symbol for r in step.batch + step.joined})
            self._work_ready.notify()  # the pipeline has room
        self._look_at_late_steps()

    def _look_at_late_steps(self):
        """Answer the parts come of the steps with late parts, and those steps that have ended, oldest first. A
        symbol's request waits while an earlier late step misses one of that symbol's: the parts of both may come
        between the looks at the two steps, and its answers must go in order."""
        earlier = set()  # the symbols of the parts still missing in the late steps looked at so far
        for step in list(self._late):
            if not earlier & step.holding and _ended(step.pending):
                self._retire(step)
            else:
                self._take_parts(step, earlier)
            earlier |= step.holding

    def _take_parts(self, step, blocked=frozenset()):
        """Answer what has come of a step with late parts and not been answered (but for the `blocked` symbols'),
        its joins that made it with it, and hold back the symbols of the parts still missing, no others."""
        with self._work_ready:  # a join settled meanwhile as missed has left step.joined (requeued)
            requests = step.batch + step.joined
        try:
            ids, predictions, errors, restarted = check_answer(step.pending.partial(),
                                                               [r.unique_id for r in requests], partial=True)
        except Exception:  # a failing team client must not kill the runtime: the step's result() answers it all
            if not step.partial_failed:
                log.exception("team client's partial() failed; its step is answered when it ends")
            step.partial_failed = True
            ids, predictions, errors, restarted = [], np.zeros((0, NUM_TOWERS), np.float32), {}, []
        rows = [row for row, uid in enumerate(ids) if uid not in step.answered]
        errors = {uid: why for uid, why in errors.items() if uid not in step.answered}
        if blocked and (rows or errors):
            symbol_of = {r.unique_id: r.symbol for r in requests}
            rows = [row for row in rows if symbol_of[ids[row]] not in blocked]
            errors = {uid: why for uid, why in errors.items() if symbol_of[uid] not in blocked}
        if rows or errors:
            self._answer([ids[row] for row in rows], predictions[rows], errors, requests, restarted)
            step.answered.update([ids[row] for row in rows], errors)
        with self._work_ready:
            self._hold(step, {r.symbol for r in step.batch + step.joined if r.unique_id not in step.answered})

    def _hold(self, step, symbols):
        """Make `symbols` the ones `step` holds back (each symbol held while any step holds it); called holding the
        lock."""
        for symbol in symbols - step.holding:
            self._held[symbol] = self._held.get(symbol, 0) + 1
        released = step.holding - symbols
        for symbol in released:
            self._held[symbol] -= 1
            if not self._held[symbol]:
                del self._held[symbol]
        step.holding = symbols
        if released:
            self._work_ready.notify()

    def _retire(self, step):
        """Wait for `step` (the oldest in flight, or one with late parts), answer it and its joins that made it (what
        was not answered before), and take it off the pipeline."""
        try:
            answer = step.pending.result()
            ended_at = time.monotonic()
        except Exception as exc:  # a failing team client must not kill the runtime
            answer, ended_at = exc, None  # a failed step's time says nothing of the next ones
        named = None if ended_at is None else _named(answer)
        with self._work_ready:
            if named is None:  # a failed or malformed answer: its joins fail with the step, whatever their fate
                for request in step.joined:
                    self._fate_failed.discard(request.unique_id)
                    if self._joining.get(request.symbol, (None,))[0] is request:
                        del self._joining[request.symbol]
            else:
                self._settle_joins(done=step.pending, answered=named)
            requests = step.batch + step.joined  # the joins that made it
        # those not answered from its parts before (a late step's): where it is none, a failure has nothing to fail
        rest = [r for r in requests if r.unique_id not in step.answered] if step.answered else requests
        if ended_at is None:
            if rest:
                self._fail(rest, answer, "submit_batch's result()")
        else:
            try:
                ids, predictions, errors, restarted = check_answer(answer, [r.unique_id for r in requests])
            except Exception as exc:  # a failing team client must not kill the runtime
                if rest:
                    self._fail(rest, exc, "submit_batch's result()")
                ended_at = None
            else:
                if step.answered:  # answered from its parts before: the rest alone
                    rows = [row for row, uid in enumerate(ids) if uid not in step.answered]
                    ids, predictions = [ids[row] for row in rows], predictions[rows]
                    errors = {uid: why for uid, why in errors.items() if uid not in step.answered}
                self._answer(ids, predictions, errors, requests, restarted)
        with self._work_ready:
            if step in self._late:
                self._hold(step, set())
                self._late.remove(step)
            else:
                self._steps.popleft()  # only now: a step counts as in flight until it is answered
                if ended_at is not None:  # (a step with late parts: its time says nothing of the next ones)
                    self._clock.ended(step.size, step.submitted_at, ended_at)
            if step.record is not None:
                step.record["joined"] = len(step.joined)
                step.record["ended"] = ended_at
            self._work_ready.notify()

    def _mark(self, stage, ids):
        if self.timeline is not None:
            now = time.monotonic()
            for uid in ids:
                self.timeline.setdefault(uid, {})[stage] = now

    def _answer(self, ids, predictions, errors, requests, restarted=()):
        """Answer `ids` (of `requests`, the step's Requests) with `predictions`, the others of `errors` with why.
        `restarted`: requests (of these) before which the team client started their symbols' states afresh."""
        self._mark("done", ids)
        if self.journal is not None:
            by_id = {r.unique_id: r for r in requests}
            if restarted:  # where their old states ended: after each one's earlier requests, before these
                answering = set(ids).union(errors)
                self.journal.forget(list(dict.fromkeys(by_id[uid].symbol for uid in restarted if uid in answering)))
            if ids:  # before the answers go: all the server saw answered is journaled
                self.journal.append([(uid, by_id[uid].symbol, by_id[uid].features) for uid in ids], predictions)
        finite = np.isfinite(predictions).all(axis=1)
        if not finite.all():  # NaN never goes out (nor is it JSON, the original protocol's): the request fails
            errors = {**errors, **{ids[row]: NON_FINITE_PREDICTION for row in np.flatnonzero(~finite)}}
            ids, predictions = [ids[row] for row in np.flatnonzero(finite)], predictions[finite]
        if ids:
            self._on_loop(self._on_batch_done, ids, predictions)
        for uid, why in errors.items():
            # each of a lost shard's symbols' requests fails for one reason to the end of the stream: a line
            # each was thousands a second on stderr
            if why not in self._errors_logged and len(self._errors_logged) < MAX_ERRORS_LOGGED:
                self._errors_logged.add(why)
                log.warning("unique_id %d not answered: %s (later requests not answered for this reason are "
                            "counted in the summary's errors, not logged)", uid, why)
            self._on_loop(self._on_requests_failed, [uid], why)

    def _fail(self, batch, exc, what):
        why = f"{type(exc).__name__}: {exc}"
        # a team's code that fails the same way at every step printed its traceback at every step (555 lines for
        # 60 requests): the first time in full, then one line
        first = why not in self._failures_logged and len(self._failures_logged) < MAX_FAILURES_LOGGED
        if first:
            self._failures_logged.add(why)
        log.error("%s failed for unique_ids %s%s", what, [r.unique_id for r in batch],
                  "" if first else f": {why} (its traceback logged before)", exc_info=exc if first else None)
        self._on_loop(self._on_requests_failed, [r.unique_id for r in batch], why)

    def _on_loop(self, callback, *args):
        """Run callback(*args) on the event loop: now where this is its thread (inline steps), else handed to it;
        either way an exception it raises is logged and goes no further, as the loop does with its callbacks."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(callback, *args)
            return
        try:
            callback(*args)
        except Exception:
            log.exception("answering unique ids failed")

    # ---- sending (event loop thread) -------------------------------------------------------------
    def _on_batch_done(self, ids, predictions):
        for uid, row in zip(ids, predictions):
            self._cache[uid] = row, self._in_flight.pop(uid, None)
        while len(self._cache) > self.cache_size:
            self._evict(self._cache.popitem(last=False)[0])
        self.stats.responses_sent += len(ids)
        if self._carried and self._ws is not None:
            crossed = self._carried.intersection(ids)
            self._carried -= crossed
            self._crossing |= crossed
        # When disconnected the answers wait in the cache for the server's resend.
        self._send(self._ws, protocol.inference_response(ids, predictions, time.time()), ids)
        self._mark("answered", ids)

    def _reject(self, ids):
        """Requests noted, then answered with an error: journaled (before the error goes), and a resend of one is
        refused again."""
        if self.journal is not None and ids:
            self.journal.refuse(ids)
        self._remember_refusals(ids)
        self.stats.note_rejected(ids)

    def _remember_refusals(self, ids):
        """A resend of any of `ids` is refused ('rejected earlier'), never stepped."""
        self._rejected_ids.update(dict.fromkeys(ids))
        for uid in ids:
            if uid - 1 in self._evicted or uid + 1 in self._evicted:
                self._evict(uid)
        # a lost shard's symbols are refused for the rest of the stream: the oldest go to _evicted, beside the
        # answers of their time long gone from the cache (a range's few bytes and a bit each, not ~140 B each)
        while len(self._rejected_ids) > REFUSALS_KEPT:
            uid = self._rejected_ids.popitem(last=False)[0]
            self._refused_long_ago.add(uid)
            self._evict(uid)

    def _evict(self, uid):
        """Into _evicted: uid, whose answer has left the cache (or a refused id next to one there), with the refused
        ids next to it (still told apart by _rejected_ids): each left a hole that split the ranges for good (~80 B
        a request refused: a lost shard's symbols' requests for the rest of the stream)."""
        self._evicted.add(uid)
        for step in (1, -1):
            other = uid + step
            while other in self._rejected_ids and other not in self._evicted:
                self._evicted.add(other)
                other += step

    def _on_requests_failed(self, ids, why):
        for uid in ids:
            self._in_flight.pop(uid, None)
        self._reject(ids)
        self._send(self._ws, protocol.error("client_error", f"unique_ids {ids} not answered: {why}"))

    def _send(self, ws, msg, answered=()):
        """Send msg on ws (None: no connection); `answered`, the ids it gives predictions, in _unsent until it goes."""
        if ws is None:
            self._unsent.update(answered)
            return
        frame = ws.encode(msg)
        if frame is not None:
            self._spawn(self._send_frame(ws, frame, answered))

    def _spawn(self, coro):
        task = self._loop.create_task(coro)
        self._send_tasks.add(task)
        task.add_done_callback(self._send_tasks.discard)

    async def _send_frame(self, ws, frame, answered=()):
        # A send stuck server_idle_s ends the connection (as the server cuts off a client that stops reading): a server
        # that read nothing while it sent on (tcp-json has no keepalive to notice) kept every answer's frame buffered
        # and its task waiting, for good (67,000 requests: 5,256 tasks and 0.9 MB buffered, growing).
        stuck = self._loop.call_later(self.server_idle_s, self._cut_off_unread, ws)
        try:
            await ws.send(frame)
            if self._unsent:  # (empty but after a lost connection: nothing to do a step)
                self._unsent.difference_update(answered)
        except transport.ConnectionClosed:
            self._unsent.update(answered)  # the server resends unanswered requests after the reconnect
        finally:
            stuck.cancel()

    def _cut_off_unread(self, ws):
        if self._unread is not ws:  # (each stuck send's timer fires)
            self._unread = ws
            ws.abort()  # a server that reads nothing would not read a close either


def _request_print(symbol, features) -> int:
    """What a request held, in one number: a resend of its unique_id must hold the same (a few hundred ns)."""
    return hash((symbol, features.tobytes()))


class _Step:
    """A step submitted to the team client, until it is answered: its requests, the team client's pending step,
    when it was submitted, its size (for the step clock), the requests joined to it, its record in `steps` (or
    None); for a step whose last parts came late, the unique ids answered from the parts that came before it
    ended, the symbols it holds back (of its parts still missing), and whether its partial() failed; whether it
    answers in parts (asked once: the event loop asks at each of its turns while a step runs, with inline steps)."""
    __slots__ = ("batch", "pending", "submitted_at", "size", "record", "joined", "answered", "holding",
                 "partial_failed", "in_parts")

    def __init__(self, batch, pending, submitted_at, size, record):
        self.batch, self.pending, self.submitted_at, self.size, self.record = batch, pending, submitted_at, size, record
        self.joined: list = []
        self.answered: set[int] = set()
        self.holding: set[str] = set()
        self.partial_failed = False
        self.in_parts = _in_parts(pending)


def _in_parts(pending) -> bool:
    """Whether a team client's pending step answers in parts: partial() and wait(timeout) (client/team_api.py)."""
    return callable(getattr(pending, "partial", None)) and callable(getattr(pending, "wait", None))


def _ended(pending) -> bool:
    """Whether a pending step has ended (its done(), where it has one: without, or where it fails, result() is
    left to wait or to say what failed)."""
    done = getattr(pending, "done", None)
    try:
        return done is None or bool(done())
    except Exception:  # a failing team client must not stop the loop's steps: result() answers for the step
        log.exception("team client's done() failed; taking the step's result")
        return True


def _waited(pending, timeout) -> bool:
    """A pending step's wait(timeout) (one answered in parts): where it fails, True (its result() says what)."""
    try:
        return bool(pending.wait(timeout))
    except Exception:  # a failing team client must not kill the completer: no step would be answered again
        log.exception("team client's wait() failed; taking the step's result")
        return True


def _named(answer) -> set | None:
    """The unique ids a team client's answer names, answered or under errors; None where it is malformed (the
    answer's check then says what is wrong)."""
    try:
        return {int(uid) for uid in answer["unique_ids"]} | {int(uid) for uid in answer.get("errors") or {}}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def _how_it_ended(ws, refusal) -> tuple[tuple, str]:
    """(the way a lost connection ended, for comparing with the next ones; the way in words)."""
    if refusal is not None and refusal["error"] in protocol.REFUSALS_THAT_PASS:
        return ("refused", refusal["error"]), f"it refused the register ({refusal['error']}: {refusal['details']})"
    if ws.client_close is not None:  # this client closed it: the server broke a rule or a limit
        code, reason = ws.client_close
        if code == 1009:
            return ("client", code), f"it sent {ws.too_big} ({code}: {reason})"
        return ("client", code), f"this client closed the connection ({code} {reason})"
    code, reason = ws.close_code, ws.close_reason
    if code is None:  # a plain close, as an original-protocol server's (it has no closing message)
        return ("server", code, reason), "the connection ended without a close code"
    return ("server", code, reason), f"the connection ended ({code}{' ' + reason if reason else ''})"
