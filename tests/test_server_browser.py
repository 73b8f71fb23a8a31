"""The leaderboard page as headless Chromium renders it (skipped where Chromium is not installed)."""
import asyncio
import os
import shutil
import subprocess

import pytest

from client import protocol
from test_server import Server, play, registered

CHROMIUM = next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome",
                                                       "google-chrome-stable", "headless_shell")) if path), None)
SERVER_WEIGHTS = "5e4e4f0f"
# Where the screenshot is kept for a person to look at (else in the test's temporary folder).
SCREENSHOT_DIR = os.environ.get("LEADERBOARD_SCREENSHOT_DIR")


def chromium(tmp_path, *args):
    """Run headless Chromium, isolated from any profile and from the network beyond loopback."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def answer_off(ids, predictions):
    """Three towers out of atol: accuracy 0.25, as a client with other weights would score."""
    wrong = predictions.copy()
    wrong[:, 1:] += 1.0
    return [protocol.encode(protocol.inference_response(ids, wrong, 0.0))]


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary installed")
def test_leaderboard_page_in_headless_chromium(tmp_path):
    shots = SCREENSHOT_DIR or tmp_path
    screenshot = os.path.join(shots, "leaderboard.png")

    async def main():
        # a slow stream, so that the page shows the teams mid-stream
        async with Server(requests=600, rate=100.0, weights_fingerprint=SERVER_WEIGHTS, preset="tiny") as s:
            good = await registered(s.url, "good-team", preset="tiny", weights_fingerprint=SERVER_WEIGHTS)
            off = await registered(s.url, "off-team", preset="tiny", weights_fingerprint="0badc0ffee",
                                   allow_weights_mismatch=True)
            gone = await registered(s.url, "gone-team")
            players = [asyncio.create_task(play(good, s.targets)),
                       asyncio.create_task(play(off, s.targets, answer_off))]
            await play(gone, s.targets, stop_after=20)
            await gone.close()
            await asyncio.sleep(0.5)  # some scores in
            url = f"http://127.0.0.1:{s.port}/"
            dom = await asyncio.to_thread(chromium, tmp_path, "--dump-dom", url)
            shot = await asyncio.to_thread(chromium, tmp_path, f"--screenshot={screenshot}",
                                           "--window-size=1600,420", url)
            for ws in (good, off):
                await ws.close()
            await asyncio.gather(*players)
            return dom, shot
    dom, shot = asyncio.run(main())
    page = dom.stdout
    assert '<table id="leaderboard">' in page, dom.stderr[-2000:]
    rows = {name: next(line for line in page.splitlines() if f"<td>{name}</td>" in line)
            for name in ("good-team", "off-team", "gone-team")}
    assert '<td class="playing">playing</td>' in rows["good-team"]
    assert '<td class="disconnected">disconnected</td>' in rows["gone-team"]
    assert '<td class="ok" title="client 5e4e4f0f, server 5e4e4f0f">match</td>' in rows["good-team"]
    assert ">differ</td>" in rows["off-team"] and ">not said</td>" in rows["gone-team"]
    assert 'class="team far-below"' in rows["off-team"] and "far-below" not in rows["good-team"]
    assert '<td class="note">accuracy far below; other weights</td>' in rows["off-team"]
    assert '<progress value="' in rows["good-team"] and '/600</td>' in rows["good-team"]
    assert "Model: preset tiny, weights 5e4e4f0f" in page
    assert "PnL: each request answered within 2 s earns (correct towers / 4)" in page
    with open(screenshot, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, shot.stderr[-2000:]
