"""The team's client: `process_batch` is the one place a team changes; main() plays a scoring server.

    python team/example_model.py --host H --port P      # play a running server
    python team/example_model.py --preset tiny           # start the project's server in-process and play it
"""
import os
import sys

# Runnable as a script from anywhere: the repository root holds the `client` and `server` packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402

import numpy as np  # noqa: E402

from client import event_loop  # noqa: E402
from client.engine import ENGINES, Engine, make_engine  # noqa: E402
from client.engine.base import NUM_TOWERS, PendingStep  # noqa: E402
from client.model.config import PRESETS  # noqa: E402


class ExampleModel:
    """Answers one micro-batch at a time. The runtime pipelines steps through submit_batch (the next step is
    queued on the GPU while the host sends the last one's answers); the local evaluator calls process_batch."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def process_batch(self, requests_by_symbol: dict[str, tuple[int, np.ndarray]]) -> dict:
        """{symbol: (unique_id, features[79])}, at most one request per symbol, each symbol's requests
        in arrival order across calls -> {"unique_ids": [...], "predictions": float32 [n, 4]}."""
        return self._submit(requests_by_symbol).result()

    def submit_batch(self, requests_by_symbol: dict[str, tuple[int, np.ndarray]]) -> PendingStep:
        """Start process_batch's step without waiting for it: result() gives process_batch's answer.
        Batches advance the states in submission order, whenever their results are collected."""
        if type(self).process_batch is not ExampleModel.process_batch:
            # A subclass that changed only process_batch (the one place a team changes) must still be what
            # answers, so run it now rather than the example's own pipelined step.
            return PendingStep.completed(self.process_batch(requests_by_symbol))
        return self._submit(requests_by_symbol)

    def _submit(self, requests_by_symbol) -> PendingStep:
        if not requests_by_symbol:
            return PendingStep.completed({"unique_ids": [], "predictions": np.zeros((0, NUM_TOWERS), np.float32)})
        symbols = list(requests_by_symbol)
        unique_ids = [requests_by_symbol[s][0] for s in symbols]
        features = np.stack([np.asarray(requests_by_symbol[s][1], dtype=np.float32) for s in symbols])
        step = self.engine.submit(symbols, features)
        return PendingStep(lambda: {"unique_ids": unique_ids, "predictions": step.result()})


def parse_args(argv=None):
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description="Play a scoring server with the team's client.")
    parser.add_argument("--host", help="server host; without it, start the project's server in-process")
    parser.add_argument("--port", type=int, help="server port (required with --host)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: full with CUDA, else tiny)")
    parser.add_argument("--weights", help="checkpoint path (default: synthetic weights from --seed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--engine", choices=ENGINES, default="fast" if cuda else "reference")
    parser.add_argument("--team", default="example")
    parser.add_argument("--token", help="registration token, if the server wants one")
    parser.add_argument("--symbols", type=int, default=20, help="embedded server: number of symbols")
    parser.add_argument("--requests", type=int, default=1000, help="embedded server: number of requests")
    parser.add_argument("--rate", type=float, help="embedded server: requests/s (default: the stream's gaps)")
    parser.add_argument("--json", metavar="PATH", help="write this client's summary as JSON")
    args = parser.parse_args(argv)
    if args.host is not None and args.port is None:
        parser.error("--host needs --port")
    if args.host is None and args.port is not None:
        parser.error("--port without --host: give --host too, or neither to start the embedded server")
    if args.symbols < 1 or args.requests < 1:
        parser.error("--symbols and --requests must be positive")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.preset is None:
        args.preset = "full" if cuda else "tiny"
        print(f"--preset not given: using {args.preset} ({'CUDA present' if cuda else 'no CUDA'})", file=sys.stderr)
    return args


async def _print_progress(stats):
    # One line rewritten in place on a terminal; a line every few seconds into a log file.
    live = sys.stderr.isatty()
    while True:
        await asyncio.sleep(0.5 if live else 5.0)
        print(("\r" if live else "") + stats.progress_line(), end="" if live else "\n", file=sys.stderr, flush=True)


async def _wait_for_last_scores(stats, num_requests, timeout_s=2.0, poll_s=0.02):
    """The server is done once it has scored everything; its last score_update may still be in flight."""
    for _ in range(int(timeout_s / poll_s)):
        if stats.scored + stats.rejected >= num_requests:
            return
        await asyncio.sleep(poll_s)


async def play(args) -> tuple[dict, list[dict] | None]:
    """Play the server given by args (or an embedded one); return (client summary, server summaries)."""
    from client.model import load_model
    from client.runtime import StreamingClient

    model, _ = load_model(args.preset, weights=args.weights, seed=args.seed, device=args.device)
    team_client = ExampleModel(make_engine(args.engine, model, device=args.device))
    server = None
    if args.host is None:
        from server.app import ScoringServer, ServerConfig

        server = ScoringServer(ServerConfig(host="127.0.0.1", port=0, preset=args.preset, weights=args.weights,
                                            seed=args.seed, symbols=args.symbols, requests=args.requests,
                                            rate=args.rate, once=True, device=args.device))
        port = await server.start()
        url = f"ws://127.0.0.1:{port}"
    else:
        url = f"ws://{args.host}:{args.port}"
    print(f"playing {url} as team {args.team!r}: preset {args.preset}, engine {args.engine}, "
          f"device {args.device}", file=sys.stderr)
    client = StreamingClient(team_client, url, args.team, args.token)
    progress = asyncio.create_task(_print_progress(client.stats))
    playing = asyncio.create_task(client.run())
    try:
        if server is not None:
            done = asyncio.create_task(server.wait_done())
            await asyncio.wait({done, playing}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                done.cancel()
            await _wait_for_last_scores(client.stats, args.requests)
            client.stop()
        summary = await playing
    finally:
        progress.cancel()
        if server is not None:
            await server.stop()
    print(("\r" if sys.stderr.isatty() else "") + client.stats.progress_line(), file=sys.stderr)
    return summary, server.summaries() if server is not None else None


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary, server_summaries = event_loop.run(play(args))
    print(json.dumps(summary, indent=2))
    if server_summaries:
        print("server summary: " + json.dumps(server_summaries, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
