"""python -m server: run the scoring server, print the summary table at the end."""
import asyncio
import json
import signal
import socket
import sys

from client import cli, event_loop
from client.model.config import PRESETS
from server.app import ScoringServer, ServerConfig
from server.leaderboard import format_table
from client.constants import ATOL, TARGET_SOURCES
from server.scoring import DEFAULT_HALF_LIFE_MS, DEFAULT_TIMEOUT_S

PROG = "python -m server"


def parse_args(argv=None) -> ServerConfig:
    parser = cli.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset of the reference targets")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", type=cli.existing_file, help="checkpoint path")
    weights.add_argument("--seed", type=int, default=0, help="seed of deterministic weights")
    parser.add_argument("--stream", type=cli.existing_file,
                        help="saved stream (.npz or parquet); else one is generated")
    parser.add_argument("--symbols", type=int, default=20)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--stream-seed", type=int, default=1)
    parser.add_argument("--rate", type=float, help="requests/s; default: the stream's own gaps")
    parser.add_argument("--speed", type=float, default=1.0, help="scale the stream's own gaps (not used with --rate)")
    parser.add_argument("--atol", type=float, default=ATOL)
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--half-life-ms", type=float, default=DEFAULT_HALF_LIFE_MS)
    parser.add_argument("--token", help="require this token at register")
    parser.add_argument("--once", action="store_true", help="exit when the first client's stream is scored")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--device", help="device of the reference model (default cpu)")
    parser.add_argument("--cache-dir", help="targets cache directory")
    parser.add_argument("--targets", choices=TARGET_SOURCES, default="model",
                        help="score against the weights' fp32 model (default) or the --stream file's own targets; a "
                             "file with targets is compared with the model either way")
    args = parser.parse_args(argv)
    if args.targets == "file" and args.stream is None:
        parser.error("--targets file needs --stream, a file that carries targets")
    try:
        return ServerConfig(host=args.host, port=args.port, preset=args.preset, weights=args.weights,
                            seed=args.seed, stream=args.stream, symbols=args.symbols, requests=args.requests,
                            stream_seed=args.stream_seed, rate=args.rate, speed=args.speed, atol=args.atol,
                            timeout_s=args.timeout_s, half_life_ms=args.half_life_ms, token=args.token,
                            once=args.once, json=args.json, device=args.device, cache_dir=args.cache_dir,
                            targets=args.targets, progress=True)
    except ValueError as exc:
        parser.error(str(exc))


def check_port_free(host: str, port: int) -> None:
    """Fail before the (long) preparation of targets when the port is taken; the server binds it later."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise cli.CliError(f"--host {host}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket will
        try:
            probe.bind(address)
        except OSError as exc:
            raise cli.CliError(f"cannot listen on {host}:{port}: {exc.strerror}; is another server there? "
                               f"stop it or choose another --port") from None


async def serve(config: ServerConfig):
    server = ScoringServer(config)
    port = await server.start()
    print(f"scoring server listening on ws://{config.host}:{port} (leaderboard http://{config.host}:{port}/; the "
          f"original protocol, newline-delimited JSON over TCP, on the same port: tcp://{config.host}:{port})",
          flush=True)
    main = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        if config.once:
            await server.wait_done()
        else:
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        pass
    finally:
        await server.stop()
        summaries = server.summaries()
        print(format_table(summaries), flush=True)
        if config.json:
            with open(config.json, "w") as f:
                json.dump(summaries, f, indent=2)


def main(argv=None) -> int:
    config = parse_args(argv)
    cli.check_device(config.device)
    check_port_free(config.host, config.port)
    try:
        event_loop.run(serve(config))
    except KeyboardInterrupt:  # Ctrl-C is how a server without --once is stopped: the table is printed
        pass
    return cli.EXIT_OK


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
