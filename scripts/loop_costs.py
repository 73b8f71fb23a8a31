"""CPU time of the team client's event loop on its own paths, per request: a request frame received (decoded,
checked, queued: StreamingClient._on_frame), a step answered (its answers cached and sent: StreamingClient._answer)
and its score received (the server's score_update), in this process with frames made here, a team client that
never steps and no socket, so that hosts and versions compare by the loop's work alone; and the link beneath them,
the same frames read off a loopback websocket through the client's transport and decoded (websockets' framing and
the loop's reads; a server process sends them as fast as the socket takes them). Past 16,000 requests/s on an H200
the loop, not the GPU, fell behind (bench/LOG.md sections 78-79); these are its per-request costs on the host that
runs it (the engine's submit not included).

    python scripts/loop_costs.py --json costs.json
    python scripts/loop_costs.py --frame-requests 1,12,40 --step-rows 64,300,512
"""
import asyncio
import importlib.util
import json
import multiprocessing
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


def _request_frames(per_frame, frames, first_id=0):
    """`frames` encoded request frames of `per_frame` requests over SYMBOLS symbols, ids from first_id."""
    import numpy as np

    from client import protocol

    features = np.random.default_rng(0).standard_normal((per_frame, 79)).astype(np.float32)
    made = []
    for uid in range(first_id, first_id + frames * per_frame, per_frame):
        ids = list(range(uid, uid + per_frame))
        made.append(protocol.encode(protocol.inference_request(ids, [f"SYM_{i % SYMBOLS:03d}" for i in ids], features,
                                                               time.time())))
    return made


def _send_frames(frames, to_parent):
    """Child process: a websocket server on loopback that sends `frames` to each connection, then waits for its
    close; its port first, to the parent."""
    from websockets.asyncio.server import serve

    from client import event_loop

    async def handler(ws):
        for frame in frames:
            await ws.send(frame)
        await ws.wait_closed()

    async def main():
        async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
            to_parent.put(server.sockets[0].getsockname()[1])
            await asyncio.Future()

    event_loop.run(main())


def wire_us(per_frame, frames, reps):
    """Best of `reps` runs: us a request (this process's CPU time) for `frames` request frames of `per_frame`
    requests read off a loopback websocket through the client's transport and decoded."""
    from client import event_loop, transport

    ctx = multiprocessing.get_context("spawn")
    to_parent = ctx.Queue()
    server = ctx.Process(target=_send_frames, args=(_request_frames(per_frame, frames), to_parent), daemon=True)
    server.start()
    try:
        url = f"ws://127.0.0.1:{to_parent.get(timeout=60)}"

        async def read_all():
            ws = await transport.connect(url, open_timeout=30)
            begin, read = time.process_time(), 0
            async for frame in ws:
                ws.decode(frame)
                read += 1
                if read == frames:
                    break
            spent = time.process_time() - begin
            await ws.close()
            return spent / (frames * per_frame) * 1e6

        return min(event_loop.run(read_all()) for _ in range(reps))
    finally:
        server.kill()
        server.join()


def receive_us(per_frame, frames, reps):
    """Best of `reps` runs: us a request for `frames` request frames of `per_frame` requests over SYMBOLS symbols
    through _on_frame, the queued requests taken by a step every 25 frames (as a loaded client's are)."""
    from client import protocol

    best = float("inf")
    for rep in range(reps):
        client, link = _client(), _Link(protocol)
        batch = _request_frames(per_frame, frames, rep * frames * per_frame)
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


def score_us(rows, steps, reps):
    """Best of `reps` runs: us a request for `steps` score_update frames of `rows` requests each (the server's
    answer to a step's inference_response) through _on_frame."""
    from client import protocol

    best, uid = float("inf"), 0
    for _ in range(reps):
        client, link = _client(), _Link(protocol)
        frames = []
        for _ in range(steps):
            ids = list(range(uid, uid + rows))
            uid += rows
            for i in ids:
                client.stats.note_request(i)
            frames.append(protocol.encode(protocol.score_update(ids, [0.5] * rows, [4] * rows, [3.25] * rows)))
        begin = time.perf_counter()
        for frame in frames:
            client._on_frame(link, frame)
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
    has_websockets = importlib.util.find_spec("websockets") is not None
    if not has_websockets:
        print("link: not measured (websockets is not installed: pip install websockets)", flush=True)
    result = {"receive_us_per_request": {}, "wire_us_per_request": {}, "answer_us_per_request": {},
              "score_us_per_request": {}}
    for per_frame in args.frame_requests:
        frames = max(args.requests // per_frame, 1)
        us = receive_us(per_frame, frames, args.reps)
        result["receive_us_per_request"][str(per_frame)] = round(us, 3)
        print(f"receive, {per_frame:>4} requests a frame: {us:7.2f} us a request", flush=True)
        if not has_websockets:
            continue
        us = wire_us(per_frame, frames, args.reps)
        result["wire_us_per_request"][str(per_frame)] = round(us, 3)
        print(f"link,    {per_frame:>4} requests a frame: {us:7.2f} us a request (read off a websocket, decoded)",
              flush=True)
    for rows in args.step_rows:
        us = answer_us(rows, max(args.requests // rows, 1), args.reps)
        result["answer_us_per_request"][str(rows)] = round(us, 3)
        print(f"answer,  {rows:>4} requests a step:  {us:7.2f} us a request", flush=True)
        us = score_us(rows, max(args.requests // rows, 1), args.reps)
        result["score_us_per_request"][str(rows)] = round(us, 3)
        print(f"score,   {rows:>4} requests a step:  {us:7.2f} us a request (the server's score_update)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
