"""python -m server: run the scoring server, print the summary table at the end."""
import os
import signal
import sys


# The console script (pyproject.toml) imports this module before it calls run(): started as it, Ctrl-C is taken over
# before the imports too, and its line names the console script (client.cli.prog_name's rule; not imported yet).
_CONSOLE_SCRIPT = bool(sys.argv) and os.path.basename(sys.argv[0]) == "fastens-server"
_INTERRUPTED = f"{'fastens-server' if _CONSOLE_SCRIPT else 'python -m server'}: interrupted"


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

import argparse  # noqa: E402
import asyncio  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import socket  # noqa: E402

from client import cli, event_loop  # noqa: E402
from client.model.config import PRESETS  # noqa: E402
from server.app import ScoringServer, ServerConfig, listen_error, server_tls  # noqa: E402
from server.identity import load_tokens  # noqa: E402
from server.leaderboard import format_table  # noqa: E402
from server.limits import Limits  # noqa: E402
from client.constants import ATOL, TARGET_SOURCES  # noqa: E402
from server.scoring import DEFAULT_HALF_LIFE_MS, DEFAULT_TIMEOUT_S  # noqa: E402

PROG = cli.prog_name("python -m server")


def parse_args(argv=None) -> ServerConfig:
    parser = cli.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--host", type=listen_host, default="127.0.0.1")
    parser.add_argument("--port", type=cli.listen_port, default=8765, help="0: any free port")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset of the reference targets")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", type=cli.existing_file, help="checkpoint path")
    weights.add_argument("--seed", type=cli.seed, default=0, help="seed of deterministic weights")
    parser.add_argument("--stream", type=cli.existing_file,
                        help="saved stream (.npz or parquet); else one is generated")
    parser.add_argument("--symbols", type=cli.positive_int, help=f"default {ServerConfig.symbols}")
    parser.add_argument("--requests", type=cli.positive_int, help=f"default {ServerConfig.requests}")
    parser.add_argument("--stream-seed", type=cli.seed, help=f"default {ServerConfig.stream_seed}")
    parser.add_argument("--rate", type=cli.request_rate, help="requests/s; default: the stream's own gaps")
    parser.add_argument("--speed", type=cli.positive_float,
                        help="scale the stream's own gaps (default 1; not with --rate)")
    parser.add_argument("--atol", type=cli.non_negative_float, default=ATOL)
    parser.add_argument("--timeout-s", type=cli.positive_float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--half-life-ms", type=cli.positive_float, default=DEFAULT_HALF_LIFE_MS)
    tokens = parser.add_mutually_exclusive_group()
    tokens.add_argument("--token", help="require this token at register, of every team")
    tokens.add_argument("--tokens", type=cli.existing_file, metavar="FILE",
                        help='a token per team: a JSON object {"team": "token", ...}; only those teams play')
    parser.add_argument("--tls-cert", type=cli.existing_file, metavar="FILE",
                        help="serve both protocols over TLS (wss://, tcp+tls://, the leaderboard https://) with this "
                             "PEM certificate chain; without it tokens and session keys cross the network as text")
    parser.add_argument("--tls-key", type=cli.existing_file, metavar="FILE",
                        help="the certificate's private key (PEM; default: in --tls-cert)")
    parser.add_argument("--once", action="store_true", help="exit when the first client's stream is scored")
    parser.add_argument("--json", type=cli.output_file, help="write the summary here")
    parser.add_argument("--device", help="device of the reference model (default cpu)")
    parser.add_argument("--cache-dir", help="targets cache directory")
    parser.add_argument("--targets", choices=TARGET_SOURCES, default="model",
                        help="score against the weights' fp32 model (default) or the --stream file's own targets; a "
                             "file with targets is compared with the model either way")
    add_limit_arguments(parser)
    args = parser.parse_args(argv)
    if args.targets == "file" and args.stream is None:
        parser.error("--targets file needs --stream, a file that carries targets")
    if args.rate is not None and args.speed is not None:  # else silently ignored: --rate sets every gap
        parser.error("--speed scales the stream's own gaps; --rate replaces them: give one")
    generation = {name: getattr(args, name) for name in ("symbols", "requests", "stream_seed")
                  if getattr(args, name) is not None}
    if args.stream is not None and generation:  # else silently ignored: the file's requests played as they are
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in generation)}: for a generated stream; "
                     f"--stream plays the file's own requests")
    try:
        limits = Limits(max_teams=args.max_teams, max_connections_per_address=args.max_connections_per_address,
                        registrations_per_s=args.registrations_per_s, registration_burst=args.registration_burst,
                        max_field_chars=args.max_field_chars, bad_token_delay_s=args.bad_token_delay_s,
                        max_unregistered_sockets=args.max_unregistered_sockets,
                        new_socket_burst=args.new_socket_burst, new_sockets_per_s=args.new_sockets_per_s)
        config = ServerConfig(host=args.host, port=args.port, preset=args.preset, weights=args.weights,
                            seed=args.seed, stream=args.stream, **generation, rate=args.rate, speed=args.speed or 1.0,
                            atol=args.atol, timeout_s=args.timeout_s, half_life_ms=args.half_life_ms, token=args.token,
                            tokens=load_tokens(args.tokens) if args.tokens else None, limits=limits,
                            once=args.once, json=args.json, device=args.device, cache_dir=args.cache_dir,
                            targets=args.targets, progress=True, tls_cert=args.tls_cert, tls_key=args.tls_key)
        server_tls(args.tls_cert, args.tls_key)  # a certificate that cannot serve, said before the targets
        return config
    except ValueError as exc:
        parser.error(str(exc))


def listen_host(text: str) -> str:
    """argparse type: an address (or name) of this machine, an IPv6 one with or without its brackets. A url, or
    [::1], failed only after a warning that the server listened beyond loopback, as 'Name or service not known'."""
    if "://" in text:
        raise argparse.ArgumentTypeError(f"takes an address of this machine, not a url, got {text!r}; the port is "
                                         f"--port")
    return cli.host_name(text)


def add_limit_arguments(parser):
    """What strangers may take of the server (server/limits.py), each with its default."""
    defaults = Limits()
    group = parser.add_argument_group("limits")
    group.add_argument("--max-teams", type=cli.positive_int, default=defaults.max_teams, metavar="N",
                       help=f"teams the server holds; more are refused (default {defaults.max_teams})")
    group.add_argument("--max-connections-per-address", type=cli.positive_int, metavar="N",
                       default=defaults.max_connections_per_address,
                       help=f"open connections (websocket or tcp-json) from one address, and 4 times as many "
                            f"sockets of any kind (default {defaults.max_connections_per_address})")
    group.add_argument("--registrations-per-s", type=cli.positive_float, default=defaults.registrations_per_s,
                       metavar="R",
                       help=f"registrations a second from one address, refused or not (default "
                            f"{defaults.registrations_per_s:g}), after a burst of --registration-burst")
    group.add_argument("--registration-burst", type=cli.positive_int, default=defaults.registration_burst,
                       metavar="N",
                       help=f"registrations one address may make at once (default {defaults.registration_burst})")
    group.add_argument("--max-field-chars", type=cli.positive_int, default=defaults.max_field_chars, metavar="N",
                       help=f"characters of a register's token, preset, weights fingerprint or session key "
                            f"(default {defaults.max_field_chars}; a team name is 1..64)")
    group.add_argument("--bad-token-delay-s", type=cli.non_negative_float, default=defaults.bad_token_delay_s,
                       metavar="S",
                       help=f"seconds before a wrong token is answered (default {defaults.bad_token_delay_s:g})")
    group.add_argument("--max-unregistered-sockets", type=cli.positive_int, metavar="N",
                       default=defaults.max_unregistered_sockets,
                       help=f"open sockets, across all addresses, not (yet) a registered team's connection: idle, "
                            f"mid-handshake, page loads; a new one past them closes the oldest (default "
                            f"{defaults.max_unregistered_sockets})")
    group.add_argument("--new-sockets-per-s", type=cli.positive_float, default=defaults.new_sockets_per_s,
                       metavar="R",
                       help=f"new sockets a second from one address, of any kind (a websocket, a page load, nothing "
                            f"yet), after a burst of --new-socket-burst; those past it are closed as they are "
                            f"accepted, unread (default {defaults.new_sockets_per_s:g})")
    group.add_argument("--new-socket-burst", type=cli.positive_int, default=defaults.new_socket_burst,
                       metavar="N",
                       help=f"new sockets one address may open at once (default {defaults.new_socket_burst})")


def exposure_warning(config: ServerConfig) -> str | None:
    """A warning when the server listens beyond this machine and anyone reaching it may register any team."""
    if config.token is not None or config.tokens is not None:
        return None
    try:
        loopback = ipaddress.ip_address(config.host).is_loopback
    except ValueError:  # a host name
        loopback = config.host == "localhost"
    if loopback:
        return None
    return (f"warning: listening on {config.host} without --token or --tokens: anyone who reaches port "
            f"{config.port} may register a team; give --tokens FILE (a token per team) to a server other "
            f"machines can reach")


LONG_PLAY_S = 3600.0


def long_play_warning(config: ServerConfig, stream) -> str | None:
    """A warning when the stream's own gaps make a team's play last over an hour: a file of gaps that are
    timestamps or seconds (each under a day) played silently for days."""
    from server.session import send_offsets

    play_s = float(send_offsets(len(stream), stream.delay_ms, config.rate, config.speed)[-1])
    if play_s <= LONG_PLAY_S:
        return None
    return (f"warning: a team's play of the stream lasts {play_s / 3600:,.1f} h at "
            f"{'--rate' if config.rate else 'its own gaps (delay_ms)'}; --rate or --speed plays it faster")


def raise_open_files_limit() -> None:
    """Every socket a stranger holds open (64 an address, until its timeout) is a file descriptor: under the usual
    soft limit of 1,024, 16 addresses took them all, and the server accepted no team. Up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit the kernel does not take as a soft one (unlimited)
            pass


def check_port_free(host: str, port: int) -> None:
    """Fail before the (long) preparation of targets when the port is taken or the host is not this machine's; the
    server binds it later."""
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
            raise cli.CliError(listen_error(host, port, exc)) from None


def listening_line(host: str, port: int, tls: bool = False) -> str:
    """The line that says where the server listens, its urls as a browser and the team client take them."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in a url takes brackets
    ws, http, tcp = ("wss", "https", "tcp+tls") if tls else ("ws", "http", "tcp")
    return (f"scoring server listening on {ws}://{where} (leaderboard {http}://{where}/; the original protocol, "
            f"newline-delimited JSON over TCP{' and TLS' if tls else ''}, on the same port: {tcp}://{where})")


async def serve(server: ScoringServer) -> int:
    """Serve until done (--once), Ctrl-C or SIGTERM; print the table; exit code 130 after Ctrl-C, else 0."""
    config = server.config
    port = await server.start()
    print(listening_line(config.host, port, config.tls_cert is not None), flush=True)
    main, loop = asyncio.current_task(), asyncio.get_running_loop()
    interrupted = []

    def ctrl_c():
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C, while stopping, interrupts at once
        interrupted.append(True)
        main.cancel()

    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    loop.add_signal_handler(signal.SIGINT, ctrl_c)
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
    return cli.EXIT_INTERRUPTED if interrupted else cli.EXIT_OK


def main(argv=None) -> int:
    config = parse_args(argv)
    warning = exposure_warning(config)
    if warning:
        print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
    cli.check_device(config.device)
    check_port_free(config.host, config.port)
    event_loop.loop_factory()  # a bad EVENT_LOOP said now, not after the targets
    raise_open_files_limit()
    server = ScoringServer(config)
    # Here, not in a thread of the event loop, so that Ctrl-C stops the (long) preparation of the targets at
    # once; once serving, it stops the server with the table so far (serve).
    server.prepare()
    warning = long_play_warning(config, server.stream)
    if warning:
        print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
    return event_loop.run(serve(server))


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    _ctrl_c_exits_until_serving()
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
