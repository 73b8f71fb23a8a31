"""CPU time of the team client's event loop on its own paths, per request: a request frame received (decoded,
checked, queued: StreamingClient._on_frame) and a step answered (its answers cached and sent:
StreamingClient._answer), in this process with frames made here, a team client that never steps and no socket, so
that hosts and versions compare by the loop's work alone. Past 16,000 requests/s on an H200 the loop, not the GPU,
fell behind (bench/LOG.md section 78); these are its per-request costs on the host that runs it (websockets' own
framing and the engine's submit not included).

    python scripts/loop_costs.py --json costs.json
    python scripts/loop_costs.py --frame-requests 1,12,40 --step-rows 64,300,512
"""
import json
import sys
import threading
import time

from client import cli

PROG = "scripts/loop_costs.py"
SYMBOLS = 64


class _Team:
    """A team client of several requests a symbol that keeps its states on its device (nothing to prefetch)."""
    requests_per_symbol = "many"
    moves_states = False

    def process_batch(self, batch):
        raise AssertionError("loop_costs steps nothing")


class _Link:
    """The connection as the runtime's frame handler and answers use it: encodes, sends nowhere."""

    def __init__(self, protocol):
        self.protocol = protocol

    def decode(self, frame):
        return self.protocol.decode(frame)

    def encode(self, msg):
        return self.protocol.encode(msg)


def _client(cache_size=None):
    from client.runtime import StreamingClient

    client = StreamingClient(_Team(), "ws://127.0.0.1:1", "loop-costs", inline_steps=False,
                             **({"cache_size": cache_size} if cache_size else {}))
    client._welcomed = True
    client._loop_thread = threading.get_ident()  # answers handed to the loop run here, at once
    client._spawn = lambda coro: coro.close()    # sends go nowhere
    return client


def receive_us(per_frame, frames, reps):
    """Best of `reps` runs: us a request for `frames` request frames of `per_frame` requests over SYMBOLS symbols
    through _on_frame, the queued requests taken by a step every 25 frames (as a loaded client's are)."""
    import numpy as np

    from client import protocol

    rng = np.random.default_rng(0)
    features = rng.standard_normal((per_frame, 79)).astype(np.float32)
    best, uid = float("inf"), 0
    for _ in range(reps):
        client, link = _client(), _Link(protocol)
        batch = []
        for _ in range(frames):
            ids = list(range(uid, uid + per_frame))
            uid += per_frame
            batch.append(protocol.encode(protocol.inference_request(
                ids, [f"SYM_{i % SYMBOLS:03d}" for i in ids], features, time.time())))
        begin = time.perf_counter()
        for i, frame in enumerate(batch):
            client._on_frame(link, frame)
            if i % 25 == 24:
                for request in client._scheduler.next_batch(None, 8):
                    client._in_flight.pop(request.unique_id, None)
        best = min(best, (time.perf_counter() - begin) / (frames * per_frame) * 1e6)
    return best


def answer_us(rows, steps, reps):
    """Best of `reps` runs: us a request for `steps` steps of `rows` answers through _answer (the cache kept at
    10 steps' answers, so that each step also evicts a step's)."""
    import numpy as np

    from client import protocol
    from client.scheduler import Request

    rng = np.random.default_rng(0)
    predictions = rng.standard_normal((rows, 4)).astype(np.float32)
    features = rng.standard_normal(79).astype(np.float32)
    best, uid = float("inf"), 0
    for _ in range(reps):
        client = _client(cache_size=10 * rows)
        client._ws = _Link(protocol)
        made = []
        for _ in range(steps):
            requests = [Request(i, f"SYM_{i % SYMBOLS:03d}", features) for i in range(uid, uid + rows)]
            uid += rows
            for request in requests:
                client._in_flight[request.unique_id] = ("", 0)
            made.append(([r.unique_id for r in requests], requests))
        begin = time.perf_counter()
        for ids, requests in made:
            client._answer(ids, predictions, {}, requests)
        best = min(best, (time.perf_counter() - begin) / (steps * rows) * 1e6)
    return best


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--frame-requests", type=cli.positive_ints, default=[1, 12, 40],
                        help="requests a frame (default 1,12,40: the event's load, 20,000 req/s, a burst)")
    parser.add_argument("--step-rows", type=cli.positive_ints, default=[1, 64, 300],
                        help="answers a step (default 1,64,300)")
    parser.add_argument("--requests", type=cli.positive_int, default=60_000, help="requests a measurement")
    parser.add_argument("--reps", type=cli.positive_int, default=3, help="runs a measurement, the best kept")
    parser.add_argument("--json", type=cli.output_file, help="write the numbers here")
    args = parser.parse_args(argv)
    result = {"receive_us_per_request": {}, "answer_us_per_request": {}}
    for per_frame in args.frame_requests:
        us = receive_us(per_frame, max(args.requests // per_frame, 1), args.reps)
        result["receive_us_per_request"][str(per_frame)] = round(us, 3)
        print(f"receive, {per_frame:>4} requests a frame: {us:7.2f} us a request", flush=True)
    for rows in args.step_rows:
        us = answer_us(rows, max(args.requests // rows, 1), args.reps)
        result["answer_us_per_request"][str(rows)] = round(us, 3)
        print(f"answer,  {rows:>4} requests a step:  {us:7.2f} us a request", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
