"""The leaderboard's page and /scores.json from a snapshot rebuilt at most once every `max_age_s`, off the event loop.

A burst of page loads costs one rebuild: on the event loop only the copies of each team's counters and latencies
(`collect`), in a worker thread the percentiles, the sort, the HTML and the JSON (`build`), so that the teams
playing are not kept waiting however many read the page. Every field a stranger can set is bounded at register
(server/limits.py), and so are the teams, so the page is bounded in size too.
"""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor


class LeaderboardSnapshot:
    def __init__(self, collect, build, max_age_s: float = 1.0, clock=time.monotonic):
        """collect() -> raw (called on the event loop); build(raw) -> (page, json) (called in a thread)."""
        self._collect, self._build, self.max_age_s, self._clock = collect, build, max_age_s, clock
        self._built_at = None
        self._current: tuple[str, str] | None = None
        self._rebuild: asyncio.Future | None = None
        # a thread of its own: the loop's default executor may be busy (or full) with other work
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leaderboard")

    async def get(self) -> tuple[str, str]:
        """(page HTML, scores JSON), at most max_age_s old; concurrent callers share one rebuild."""
        if self._current is not None and self._clock() - self._built_at < self.max_age_s:
            return self._current
        if self._rebuild is None:
            self._rebuild = asyncio.ensure_future(self._refresh())
        rebuild = self._rebuild
        return await asyncio.shield(rebuild)  # one caller going away does not cancel the others' rebuild

    async def _refresh(self) -> tuple[str, str]:
        try:
            raw, started = self._collect(), self._clock()
            self._current = await asyncio.get_running_loop().run_in_executor(self._thread, self._build, raw)
            self._built_at = started
            return self._current
        finally:
            self._rebuild = None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
