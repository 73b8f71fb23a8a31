"""One team's run through the stream: its schedule, what was sent and answered, its score.

A session outlives connections: it keeps its clock while the team is disconnected (requests that
fall due then count as sent and time out as usual), and on reconnect resends, in order, every request not
yet answered before it continues the stream; a resent frame carries its first request's send time.
"""
import asyncio
import math
import time
from collections import deque

import numpy as np

from client import protocol
from server.limits import InboundBudget
from server.scoring import score_responses

PENDING, ANSWERED, MISSED, LATE = 0, 1, 2, 3  # LATE: missed, then answered after the timeout
RECENT_WINDOW_S = 10.0
MAX_NOTICES, NOTICE_CHARS = 10, 600  # a team's notices kept (the first ones), and the length of each
# While nobody is connected a session marks what fell due (at its due time) and what was missed this often, not
# at every request: 64 teams left disconnected at 200 requests/s took a third of the server's core.
DISCONNECTED_TICK_S = 0.25
# A score update sent just before a connection dropped may be lost with it, and the team's own count of what was
# scored then falls short for good: each one sent in the last SCORES_KEPT_S seconds (at most SCORES_KEPT_IDS ids) is
# sent again on the team's next connection (a client counts each id's score once), and on the one after it too until
# the client answers a request sent after them (a connection that dropped as well lost them for good).
SCORES_KEPT_S = 30.0
SCORES_KEPT_IDS = 8192
# A summary's latency statistics over every answer so far cost ~40 ns an answer: a leaderboard rebuild took 1.4 s a
# team of 35M answers (64 teams' day-long streams: ~90 s a page). Once a team's take LATENCY_STATS_EXACT_S or more,
# they are computed again only after LATENCY_STATS_REUSE times that cost, times the teams on the page, has passed:
# the rebuilds then spend at most ~1/LATENCY_STATS_REUSE of the time on them. Below that, and for a finished session,
# they are exact.
LATENCY_STATS_EXACT_S = 0.01
LATENCY_STATS_REUSE = 10


def send_offsets(num_requests, delay_ms, rate=None, speed=1.0) -> np.ndarray:
    """Seconds after a session's start at which each request falls due."""
    if rate is not None:
        return np.arange(num_requests, dtype=np.float64) / rate
    # delay_ms is the gap before each request
    return np.cumsum(np.asarray(delay_ms, dtype=np.float64)) / 1000.0 / speed


class LatencyStats:
    """A team's latency statistics as its summaries say them (p50, p90, p99, mean, max over its answers in time),
    computed again only when due (LATENCY_STATS_REUSE). The leaderboard's thread and the event loop both ask: the
    state is one tuple, replaced whole."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._last = (-1, {}, 0.0, 0.0)  # (answers, stats, their cost in s, when computed)

    def of(self, latencies: np.ndarray, final: bool, teams: int = 1) -> dict:
        """The statistics of `latencies` (the answers so far, in the order answered), or the last ones while not due;
        teams: how many teams' statistics the caller computes in turn (the leaderboard's)."""
        answers, stats, cost, at = self._last
        begin = self._clock()
        recent = not final and cost >= LATENCY_STATS_EXACT_S and begin - at < LATENCY_STATS_REUSE * teams * cost
        if answers == len(latencies) or recent:
            return dict(stats)
        if len(latencies):
            # in one call: a partition each took 64 teams of 500,000 answers 1.2 s a leaderboard rebuild
            p50, p90, p99 = np.percentile(latencies, [50, 90, 99]).tolist()
            stats = {"p50": p50, "p90": p90, "p99": p99, "mean": float(latencies.mean()),
                     "max": float(latencies.max())}
        else:
            stats = dict.fromkeys(("p50", "p90", "p99", "mean", "max"))
        self._last = (len(latencies), stats, self._clock() - begin, begin)
        return dict(stats)


class TeamSession:
    def __init__(self, team, symbols, features, targets, offsets, *, atol, half_life_ms, timeout_s,
                 send_stall_s, max_requests_per_message, clock=time.monotonic, wall_clock=time.time):
        self.team = team
        self._symbols = symbols
        self._features = features
        self._targets = targets
        self._offsets = offsets
        self._atol = atol
        self._half_life_ms = half_life_ms
        self._timeout_s = timeout_s
        self._send_stall_s = send_stall_s
        self._chunk = max_requests_per_message
        self._clock = clock
        self.start = clock()
        self._wall_offset = wall_clock() - self.start
        total = len(offsets)
        self.total = total
        self.sent = 0
        self._send_time = np.full(total, np.nan)
        self._state = np.zeros(total, dtype=np.int8)
        self._latency_ms = np.full(total, np.nan)
        # the same latencies in the order answered, the first `responses` of it: a snapshot hands the leaderboard's
        # thread that prefix, which no later answer changes, instead of gathering them on the event loop (64 teams'
        # streams of 1M requests: 242-291 ms a page rebuild). np.empty: the memory is touched only as answers come
        self._answered_latency_ms = np.empty(total)
        self._latency_stats = LatencyStats(clock)
        self._reap_cursor = 0
        self.resolved = 0
        self.responses = self.missed = self.late = self.errors = self.duplicates = self.client_errors = 0
        self.notices: list[dict] = []  # the client's notices (protocol.CLIENT_NOTICES), the first MAX_NOTICES
        self.notices_total = 0
        self.correct_towers = 0
        self.pnl = 0.0
        self._recent = deque()  # (receive time, pnl of one response message)
        # their sum, kept as they come and go: a snapshot (on the event loop) summed the window, ~200,000 messages a
        # team at 20,000 one-request messages a second
        self._recent_pnl = 0.0
        self._recent_scoring = 0  # of those messages, the ones with PnL: with none, the sum is exactly 0.0
        self._scores_sent = deque()  # (send time, ids, encoded score_update) of the last SCORES_KEPT_S seconds
        self._scores_sent_ids = 0
        # of those, the first ones sent again on the live connection, kept until the client answers a request first
        # sent from `_confirm_from` on (sent after them on that connection: it read them)
        self._scores_resent = 0
        self._confirm_from = 0
        self.inbound = InboundBudget(clock=clock)
        # a missed request resent on a reconnect is open again for the inbound budget (its late answer, or the
        # client's refusal of it, takes bytes; counted resolved, a backlog's answers past the allowance were refused
        # unread): 1 from its first resend until answered, 2 after. Each request's bytes are granted when first sent
        # and, missed, when first resent: reconnecting again and again grants nothing more
        self._reopened = np.zeros(total, dtype=np.int8)
        self.reopened = 0  # of those, the ones at 1
        self.connection = None
        self._attached_at = -math.inf  # when the live connection was attached (the session's clock)
        self.connections = 0
        self.weights_fingerprint = None  # the client's, as its latest register said (None: not said)
        self.weights_match = None        # against the server's model (None: one side did not say)
        self._resend = False
        self._wake = asyncio.Event()
        self.finished_at = None
        self.done = asyncio.Event()      # every request resolved
        self.ended = asyncio.Event()     # ... and the end message sent (or nobody was connected to get it)
        self._end_announced = False

    # connections -------------------------------------------------------------------------------
    def attach(self, connection, weights_fingerprint=None, weights_match=None):
        """Make connection the team's live one; returns the one it replaces (or None)."""
        previous, self.connection = self.connection, connection
        self.weights_fingerprint, self.weights_match = weights_fingerprint, weights_match
        self.connections += 1
        self._attached_at = self._clock()
        self._confirm_from = self.sent  # the requests sent from now on go on this connection alone
        self._resend = self.sent > 0
        self._wake.set()
        return previous

    @property
    def open_requests(self) -> int:
        """The requests whose answers the inbound budget holds bytes for: sent and not resolved, and the missed ones
        resent since and not answered."""
        return self.sent - self.resolved + self.reopened

    def detach(self, connection):
        if self.connection is connection:
            self.connection = None

    # sending -----------------------------------------------------------------------------------
    async def run(self):
        """Send requests as they fall due and mark the unanswered ones missed, until all are resolved."""
        while self.resolved < self.total:
            self._wake.clear()
            if self.connection is not None and self._resend:
                self._resend = False
                await self._send_backlog(self.connection)
            now = self._clock()
            due = int(np.searchsorted(self._offsets, now - self.start, side="right"))
            if due > self.sent:
                first, self.sent = self.sent, due
                if self.connection is not None:
                    # what fell due before the connection came (nobody connected: looked at once a tick) counts as
                    # sent when it fell due, as it would have at the tick; the rest went out now
                    due_at = self.start + self._offsets[first:due]
                    self._send_time[first:due] = np.where(due_at < self._attached_at, due_at, now)
                    await self._send_requests(self.connection, np.arange(first, due), self._send_time[first])
                else:  # sent, as far as scoring goes, when each fell due
                    self._send_time[first:due] = self.start + self._offsets[first:due]
            self._reap(self._clock())
            if self.resolved >= self.total:
                break
            next_due = self.start + self._offsets[self.sent] if self.sent < self.total else math.inf
            next_miss = (self._send_time[self._reap_cursor] + self._timeout_s
                         if self._reap_cursor < self.sent else math.inf)
            delay = min(next_due, next_miss) - self._clock()
            if self.connection is None:  # attach() wakes it at once
                delay = max(delay, DISCONNECTED_TICK_S)
            if delay > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                except TimeoutError:
                    pass
        await self.announce_end()

    async def announce_end(self):
        """Tell the live connection, once, that the stream is over. Called by whoever resolved the last
        request, after sending what it had to (the server after the last score_update; run() after reaping)."""
        if self._end_announced:
            return
        self._end_announced = True
        if self.connection is not None:
            await self.send(self.connection, protocol.encode(protocol.end(self.total)))
        self.ended.set()

    async def _send_backlog(self, connection):
        """Resend, in order, every sent request not yet answered, up to max_requests_per_message a frame, each
        frame with its first request's send time. (Grouped as first sent, the requests that fell due while the
        team was away went one a frame: a backlog of 50,000 took 2.7 s to resend.)"""
        backlog = np.flatnonzero((self._state[:self.sent] == PENDING) | (self._state[:self.sent] == MISSED))
        again = backlog[(self._state[backlog] == MISSED) & (self._reopened[backlog] == 0)]
        self._reopened[again] = 1
        self.reopened += len(again)
        self.inbound.grant(len(again))
        for begin in range(0, len(backlog), self._chunk):
            group = backlog[begin:begin + self._chunk]
            if not await self._send_requests(connection, group, self._send_time[group[0]], grant=False):
                return

    async def _send_requests(self, connection, ids, send_time, grant=True) -> bool:
        timestamp = self._wall_offset + send_time
        if grant:
            self.inbound.grant(len(ids))
        for begin in range(0, len(ids), self._chunk):
            part = ids[begin:begin + self._chunk]
            msg = protocol.inference_request(part, self._symbols[part], self._features[part], timestamp)
            if not await self.send(connection, protocol.encode(msg)):
                return False
        return True

    async def send(self, connection, frame) -> bool:
        """Send one frame; a client that stops reading is cut off after send_stall_s so that the
        server keeps its pace and buffers at most one frame for it."""
        task = asyncio.ensure_future(connection.send(frame))
        # (should the session be cancelled meanwhile, the send's own end is of no interest: not an unseen error)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        done, _ = await asyncio.wait({task}, timeout=self._send_stall_s)
        if not done:
            connection.transport.abort()  # the websockets docs advise closing, not cancelling, a stuck send
        try:
            await task
            return True
        except Exception:  # closed or aborted: the team is disconnected until it registers again
            self.detach(connection)
            return False

    def _reap(self, now):
        deadline = now - self._timeout_s
        cursor = self._reap_cursor
        while cursor < self.sent and self._send_time[cursor] <= deadline:
            if self._state[cursor] == PENDING:
                self._state[cursor] = MISSED
                self.missed += 1
                self.resolved += 1
            cursor += 1
        self._reap_cursor = cursor
        self._check_done(now)

    def _check_done(self, now):
        if self.resolved >= self.total and self.finished_at is None:
            self.finished_at = now
            self.done.set()

    # receiving ---------------------------------------------------------------------------------
    def handle_response(self, unique_ids, predictions, received):
        """Score one inference_response; returns (score_update message or None, [(error, details)])."""
        # msgpack carries ids up to 2**64 - 1; any id beyond int64 is unknown anyway (-1 here; errors name it as sent)
        ids = np.array([i if -2**63 <= i < 2**63 else -1 for i in unique_ids], dtype=np.int64)
        problems = []
        known = (ids >= 0) & (ids < self.sent)
        finite = np.isfinite(predictions).all(axis=1)
        state = self._state[np.where(known, ids, 0)]
        answered_before = known & ((state == ANSWERED) | (state == LATE))
        # an id's answer in this message is its first finite row; its other finite rows, and every row of an id
        # answered before, are duplicates. A NaN row answers nothing, so is no duplicate: it leaves its id open,
        # here to a finite row after it and in a later message alike
        open_finite = np.flatnonzero(known & finite & ~answered_before)
        accept = np.zeros(len(ids), dtype=bool)
        accept[open_finite[np.unique(ids[open_finite], return_index=True)[1]]] = True
        repeated = known & (answered_before | (finite & ~accept))
        refused = known & ~finite & ~answered_before
        if (~known).any():
            self.errors += 1
            unknown = [i for i, k in zip(unique_ids, known) if not k]
            problems.append(("unknown_ids",
                             f"ids never sent to team {self.team!r}: {protocol.few_ids(unknown)}"))
        if repeated.any():
            self.duplicates += int(repeated.sum())
            problems.append(("duplicate_ids", f"ids already answered: {protocol.few_ids(ids[repeated])}"))
        if self._scores_resent and (known & (ids >= self._confirm_from)).any():
            self._forget_scores_resent()  # the client read what was sent before that request
        update = self._score(ids[accept], predictions[accept], received) if accept.any() else None
        if refused.any():  # after scoring: whether another row of the line answered the id
            self.errors += 1
            problems.append(("non_finite_predictions", "NaN or infinite predictions: "
                             + fate_of_refused_rows(ids[refused], self.answered_among(ids[refused]))))
        return update, problems

    def answered_among(self, ids) -> list[int]:
        """Those of `ids` (integers as a client sent them, any size) whose requests are answered, in time or late."""
        known = np.array([i for i in ids if 0 <= i < self.sent], dtype=np.int64)
        state = self._state[known]
        return known[(state == ANSWERED) | (state == LATE)].tolist()

    def _score(self, accepted, predictions, received):
        """Score the answers of `accepted` (ids sent and open, once each); returns their score_update."""
        latency_ms = (received - self._send_time[accepted]) * 1000.0
        closed = accepted[self._reopened[accepted] == 1]
        self._reopened[closed] = 2
        self.reopened -= len(closed)
        correct, pnl = score_responses(predictions, self._targets[accepted], latency_ms,
                                       self._atol, self._half_life_ms)
        was_pending = self._state[accepted] == PENDING
        on_time = was_pending & (latency_ms <= self._timeout_s * 1000.0)
        pnl = np.where(on_time, pnl, 0.0)
        answered = accepted[on_time]
        self._state[answered] = ANSWERED
        self._latency_ms[answered] = latency_ms[on_time]
        self._answered_latency_ms[self.responses:self.responses + len(answered)] = latency_ms[on_time]
        self.responses += len(answered)
        self.correct_towers += int(correct[on_time].sum())
        self.missed += int((was_pending & ~on_time).sum())
        self.late += int((~on_time).sum())
        self._state[accepted[~on_time]] = LATE
        self.resolved += int(was_pending.sum())
        total_pnl = float(pnl.sum())
        self.pnl += total_pnl
        self._recent.append((received, total_pnl))
        self._recent_pnl += total_pnl
        self._recent_scoring += total_pnl != 0.0
        self._forget_before(received - RECENT_WINDOW_S)
        self._check_done(received)
        return protocol.score_update(accepted, pnl, correct, latency_ms)

    def note_scores_sent(self, frame: bytes, ids: int, now: float) -> None:
        self._scores_sent.append((now, ids, frame))
        self._scores_sent_ids += ids
        self._forget_scores_before(now - SCORES_KEPT_S)

    def scores_to_resend(self, now: float) -> list[bytes]:
        """The score updates sent on earlier connections that a drop may have lost (see SCORES_KEPT_S), oldest
        first; kept until the client answers a request sent after them on the connection they go to (cleared here,
        those sent again on a connection that dropped before the client read them were lost for good)."""
        self._forget_scores_before(now - SCORES_KEPT_S)
        self._scores_resent = len(self._scores_sent)
        self._confirm_from = self.total  # until attach(): an answer on the connection it replaces says nothing
        return [frame for _, _, frame in self._scores_sent]

    def _forget_scores_resent(self):
        for _ in range(self._scores_resent):
            self._scores_sent_ids -= self._scores_sent.popleft()[1]
        self._scores_resent = 0

    def _forget_scores_before(self, oldest):
        kept = self._scores_sent
        while kept and (kept[0][0] < oldest or self._scores_sent_ids > SCORES_KEPT_IDS):
            self._scores_sent_ids -= kept.popleft()[1]
            self._scores_resent = max(self._scores_resent - 1, 0)

    def add_notice(self, code: str, text: str):
        """A notice from the client (its states reset, a shard lost): kept for the leaderboard and summary."""
        self.notices_total += 1
        if len(self.notices) < MAX_NOTICES:
            # shown on the page and in the operator's terminal: no escape sequences, no lone surrogate (a JSON
            # line's \ud800, which no UTF-8 page can hold: every page load would fail)
            text = "".join(c if c.isprintable() else "\ufffd" for c in text[:NOTICE_CHARS])
            self.notices.append({"code": code, "text": text})

    # reporting ---------------------------------------------------------------------------------
    def _forget_before(self, oldest):
        while self._recent and self._recent[0][0] < oldest:
            pnl = self._recent.popleft()[1]
            self._recent_pnl -= pnl
            self._recent_scoring -= pnl != 0.0
        if not self._recent_scoring:  # the window empty, or none of its messages scored (a team answering wrong)
            self._recent_pnl = 0.0  # the rounding of the adds and subtractions since forgotten

    def request_times(self) -> dict:
        """Per request in stream order: when it fell due and when it was sent on the session's clock (sent NaN if
        not yet sent), and its latency in ms (NaN unless answered in time)."""
        return {"due": self.start + self._offsets, "sent": self._send_time.copy(),
                "latency_ms": self._latency_ms.copy()}

    def summary(self, now=None) -> dict:
        """The summary as it stands, its latency statistics exact (what the server reports as it stops)."""
        return summarize(self.snapshot(now), exact=True)

    def snapshot(self, now=None) -> dict:
        """The summary's raw material, copied (cheap: the event loop calls it; the latencies a view of answers no
        later one changes); summarize() finishes it anywhere, so that the percentiles of a leaderboard with many
        teams are computed off the event loop."""
        now = self._clock() if now is None else now
        self._forget_before(now - RECENT_WINDOW_S)
        window = min(RECENT_WINDOW_S, max(now - self.start, 1e-9))
        return {
            "team": self.team,
            "requests": self.sent,
            "total_requests": self.total,
            "responses": self.responses,
            "missed": self.missed,
            "late": self.late,
            "errors": self.errors,
            "client_errors": self.client_errors,
            "duplicates": self.duplicates,
            "correct_towers": self.correct_towers,
            "latencies_ms": self._answered_latency_ms[:self.responses],
            "latency_stats": self._latency_stats,
            "elapsed_s": max((self.finished_at or now) - self.start, 1e-9),
            "pnl": self.pnl,
            "recent_pnl_per_s": self._recent_pnl / window,
            "connected": self.connection is not None,
            "connections": self.connections,
            "complete": self.finished_at is not None,
            "state": self.state,
            "weights_fingerprint": self.weights_fingerprint,
            "weights_match": self.weights_match,
            "notices": list(self.notices),
            "notices_total": self.notices_total,
        }

    @property
    def state(self) -> str:
        """finished (every request resolved), playing (connected) or disconnected."""
        if self.finished_at is not None:
            return "finished"
        return "playing" if self.connection is not None else "disconnected"


def summarize(snapshot: dict, teams: int = 1, exact: bool = False) -> dict:
    """A team's summary from its snapshot (TeamSession.snapshot); teams: how many the caller summarizes in turn.
    exact: its latency statistics over every answer so far, as for a finished session (else the leaderboard's, reused
    while not due: LatencyStats)."""
    responses = snapshot["responses"]
    counts = ("team", "requests", "total_requests", "responses", "missed", "late", "errors", "client_errors",
              "duplicates")
    status = ("connected", "connections", "complete", "state", "weights_fingerprint", "weights_match", "notices",
              "notices_total")
    return {
        **{key: snapshot[key] for key in counts},
        # none without an answer in time, as the client's summary says: 0.0 read as every answer wrong
        "accuracy": snapshot["correct_towers"] / (4 * responses) if responses else None,
        "latency_ms": snapshot["latency_stats"].of(snapshot["latencies_ms"], snapshot["complete"] or exact, teams),
        "responses_per_s": responses / snapshot["elapsed_s"],
        "pnl": snapshot["pnl"],
        "pnl_per_response": snapshot["pnl"] / responses if responses else None,
        "recent_pnl_per_s": snapshot["recent_pnl_per_s"],
        **{key: snapshot[key] for key in status},
    }


def fate_of_refused_rows(refused_ids, answered) -> str:
    """What became of the requests of a line's refused rows (NaN or infinite predictions; in the original protocol
    also rows that are not 4 numbers), in words: "unique_ids X left unanswered; unique_ids Y answered by another
    row", the parts that apply, each id once. answered: those of refused_ids answered by now, the line's other rows
    scored (TeamSession.answered_among)."""
    ids = list(dict.fromkeys(int(i) for i in refused_ids))
    answered = set(answered)
    left, taken = [i for i in ids if i not in answered], [i for i in ids if i in answered]
    parts = [f"unique_ids {protocol.few_ids(left)} left unanswered"] if left else []
    if taken:
        parts.append(f"unique_ids {protocol.few_ids(taken)} answered by another row")
    return "; ".join(parts)
