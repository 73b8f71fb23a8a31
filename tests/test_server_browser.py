"""The leaderboard page as headless Chromium renders it (skipped where Chromium is not installed)."""
import asyncio
import shutil
import subprocess

import pytest

from test_server import Server, play, registered

CHROMIUM = next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome",
                                                       "google-chrome-stable", "headless_shell")) if path), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary installed")
def test_leaderboard_page_in_headless_chromium(tmp_path):
    async def main():
        async with Server() as s:
            ws = await registered(s.url, "browser-team")
            player = asyncio.create_task(play(ws, s.targets))
            await s.server.wait_done()
            result = await asyncio.to_thread(
                subprocess.run,
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"http://127.0.0.1:{s.port}/"],
                capture_output=True, text=True, timeout=60)
            await ws.close()
            await player
            return result
    result = asyncio.run(main())
    dom = result.stdout
    assert '<table id="leaderboard">' in dom, result.stderr[-2000:]
    row = next(line for line in dom.splitlines() if "browser-team" in line)
    assert row.startswith('<tr class="team"><td>1</td><td>browser-team</td>')
    assert "<td>1.0000</td>" in row  # accuracy
    assert "<td>60</td><td>0</td><td>0</td></tr>" in row  # responses, missed, errors
