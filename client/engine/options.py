"""The engines' command-line options, shared by the team client and the offline evaluator.

    --precision SPEC        weights (client/engine/precision.py)                                    fast
    --compile               each block through torch.compile                                        fast
    --state-memory SHARE    the state table's share of free memory (default 0.8), or --state-slots N  both
    --host-symbols N        states that may wait in host memory when the table is full              both
    --idle-timeout S        forget a symbol idle this long                                          both
    --state-dtype SPEC      fp32, or fp16/bf16 storage of the matrix states                         fast (fp32: both)
    --state-rounding R      stochastic|nearest, for 16-bit state                                    fast
    --gpus N                spread over N GPUs: the towers (--split towers) or the symbols          fast
    --max-requests-per-symbol K   queued requests of one symbol a step may carry (1: one per symbol per step)
    --cluster ray           the symbols sharded over the GPUs (or CPU nodes) of a Ray cluster: --ray-address ADDRESS
                            (`local` starts Ray here), --shards N (default: every GPU; one per node without GPUs)
    --on-shard-loss POLICY  a lost shard's symbols get errors (error) or start again from a fresh state (reset)
    --shard-timeout-s S     a shard that answers no step for S seconds is hung: stopped, and lost (default 60)

An option the chosen engine cannot honour is refused in one line by make_engine (client/engine/__init__.py).
"""
import argparse
import math

from client.cli import positive_float, positive_int
from client.constants import DEFAULT_REQUESTS_PER_SYMBOL
from client.engine.precision import FP32_STATE, ROUNDINGS, add_precision_argument, state_storage_argument
from client.engine.sharded import ANSWER_TIMEOUT_S, ON_SHARD_LOSS


# Each type refuses what is not a number in its own words: a ValueError read "invalid <lambda> value: 'abc'".
def _share(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 0.95):
        raise argparse.ArgumentTypeError(f"--state-memory is a share of free memory (the GPU's, or the host's on a "
                                         f"CPU) in (0, 0.95], got {text}")
    return value


def _count(text, name, minimum):
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{name} must be a whole number of at least {minimum}, got {text}")
    return value


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--idle-timeout must be a positive number of seconds, got {text}")
    return value


def add_engine_arguments(parser):
    """The engines' options, in a group of their own."""
    group = parser.add_argument_group("engine (the state table's options apply to both engines)")
    add_precision_argument(group)
    group.add_argument("--compile", action="store_true", help="each block through torch.compile (startup +~1 min)")
    memory = group.add_mutually_exclusive_group()
    memory.add_argument("--state-memory", type=_share, metavar="SHARE",
                        help="the state table's share of the memory free after the weights: GPU memory, or host "
                             "memory on a CPU (default 0.8; at most 1024 symbols on a CPU)")
    memory.add_argument("--state-slots", type=lambda t: _count(t, "--state-slots", 1), metavar="N",
                        help="symbols the state table holds on the device, instead of a memory share")
    group.add_argument("--host-symbols", type=lambda t: _count(t, "--host-symbols", 0), metavar="N",
                       help="symbols whose state may wait in pinned host memory when the GPU table is full, "
                            "pinned in the background from the start (default: what the available host memory "
                            "less max(4 GiB, 15%%) holds; 0 on the CPU and for the reference engine)")
    group.add_argument("--idle-timeout", type=_seconds, metavar="S",
                       help="forget a symbol idle this many seconds (default: never)")
    group.add_argument("--state-dtype", type=state_storage_argument, default=FP32_STATE, metavar="SPEC",
                       help="matrix state storage: fp32 (default), fp16 or bf16 (xLSTM and Mamba2; "
                            "'fp16,retnet=fp16' for RetNet too)")
    group.add_argument("--state-rounding", choices=ROUNDINGS,
                       help="how 16-bit state is rounded (default stochastic)")
    group.add_argument("--gpus", type=lambda t: _count(t, "--gpus", 1), default=1, metavar="N",
                       help="spread the engine over the first N GPUs (default 1)")
    group.add_argument("--split", choices=("towers", "symbols"),
                       help="with --gpus > 1: each GPU runs some towers for every symbol (towers, for latency), "
                            "or every tower for some symbols in a process per GPU (symbols, for throughput)")
    # default None, the measured DEFAULT_REQUESTS_PER_SYMBOL: a command tells a value given from it (the team client
    # refuses one above 1 that its team class cannot use), then sets it
    group.add_argument("--max-requests-per-symbol", type=lambda t: _count(t, "--max-requests-per-symbol", 1),
                       metavar="K",
                       help="queued requests of one symbol a step may carry, advanced in order in one step "
                            f"(default {DEFAULT_REQUESTS_PER_SYMBOL}; 1: one request per symbol per step)")
    add_cluster_arguments(parser, "shard the symbols over Ray actors, one per GPU of the cluster (CPU actors, one "
                                  "per node, where it has no GPU); --device then names the shards' device (default: "
                                  "GPUs where the cluster has any), and --engine theirs (default fast on GPUs, else "
                                  "reference)")
    return group


def add_cluster_arguments(parser, cluster_help):
    """--cluster, --ray-address, --shards, --on-shard-loss and --shard-timeout-s, in a group of their own (also
    scripts/bench.py's)."""
    cluster = parser.add_argument_group("symbols over several hosts (client/engine/shard_ray.py)")
    cluster.add_argument("--cluster", choices=("ray",), help=cluster_help)
    cluster.add_argument("--ray-address", metavar="ADDRESS",
                         help="the Ray cluster: HOST:PORT of its head (ray start --head), ray://HOST:PORT, auto, or "
                              "local to start Ray on this machine (default local)")
    cluster.add_argument("--shards", type=positive_int, metavar="N",
                         help="shards on the cluster (default: every GPU; on a cluster without GPUs, one per node)")
    cluster.add_argument("--on-shard-loss", choices=ON_SHARD_LOSS,
                         help="when a shard is lost (its process, actor or node gone): its symbols get errors "
                              "(error, the default) or start again from a fresh state on the other shards (reset, "
                              "said in the summary and to the server); every other symbol keeps playing")
    cluster.add_argument("--shard-timeout-s", type=positive_float, metavar="S",
                         help=f"a shard that answers no step for S seconds is taken as hung: stopped, and lost as "
                              f"above (default {ANSWER_TIMEOUT_S:g}; until then its symbols wait, the others play on)")
    return cluster


def engine_options(args) -> dict:
    """make_engine's keyword arguments from the parsed options."""
    storage = args.state_dtype if args.state_rounding is None else args.state_dtype.with_rounding(args.state_rounding)
    return {"precision": args.precision, "compile": args.compile, "state_memory": args.state_memory,
            "capacity": args.state_slots, "host_symbols": args.host_symbols, "idle_timeout_s": args.idle_timeout,
            "state_storage": storage, "gpus": args.gpus, "split": args.split,
            "max_rows_per_symbol": args.max_requests_per_symbol, "cluster": args.cluster,
            "ray_address": args.ray_address, "shards": args.shards, "on_shard_loss": args.on_shard_loss,
            "shard_timeout_s": args.shard_timeout_s}
