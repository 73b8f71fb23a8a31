"""Section e2e: the engine behind the team client, served 400 req/s over 20 symbols by the scoring server, several
sessions in a row (every one reported: the tail is the machine's as much as the code's, bench/LOG.md section 25)."""
import contextlib
import math

from scripts.benchmarks.awake_cpus import AwakeCpus
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import measure_e2e


def line(numbers) -> str:
    """A served session's numbers in one line (the progress log, the summary, the gpus section)."""
    return (f"p50 {fmt(numbers['p50_ms'])} ms, p99 {fmt(numbers['p99_ms'])} ms, "
            f"accuracy {fmt(numbers['accuracy'], 4)}, {fmt(numbers['responses_per_s'], 1)} responses/s"
            + (f", joins {joins['taken']} ({joins['missed']} missed)" if (joins := numbers.get("joins")) else "")
            + ("" if numbers.get("join_queued", True) else ", joins off")
            + (", inline steps" if numbers.get("inline_steps") else "")
            + (", CPUs kept awake" if numbers.get("awake_cpus") else "")
            + (", frames compressed" if numbers.get("ws_compression") else "")
            + (", over TLS" if numbers.get("tls") else "")
            + (f", journaled: {j['checkpoints']} states checkpointed, {j['segments_dropped']} segments dropped, "
               f"restart {fmt(j['restart_s'], 2)} s ({j['states_loaded']} states, {j['replayed_steps']} requests "
               f"stepped; states after it bit for bit {j['states_equal']} of {j['states']}, largest difference "
               f"{j['largest_state_difference']:.2g})" if (j := numbers.get("journal")) else "")
            + (f", host CPU taken by its hypervisor {fmt(steal)} ms/s"
               if (steal := numbers.get("host_steal_ms_per_s")) is not None else ""))


def run(bench):
    """e2e_runs sessions in a row, each recorded; the headline is the worst run (_tail). With --awake-cpus
    alternate, every second run keeps the CPUs awake (scripts/benchmarks/awake_cpus.py; with on, bench.py keeps them
    so in every section); with --ws-compression alternate, every second run compresses its websocket frames (as
    before bench/LOG.md section 50); with --tls on, every run is over TLS, alternate every second; with --journal the
    same, the client journaling with state checkpoints (serving.journaled)."""
    runs = []
    for i in range(bench.counts.e2e_runs):
        alternate = bench.args.awake_cpus == "alternate" and i % 2 == 1
        compressed = bench.args.ws_compression == "alternate" and i % 2 == 1
        tls = bench.args.tls == "on" or (bench.args.tls == "alternate" and i % 2 == 1)
        journal = bench.args.journal == "on" or (bench.args.journal == "alternate" and i % 2 == 1)
        with AwakeCpus() if alternate else contextlib.nullcontext():
            numbers = measure_e2e(bench.engine, bench, run=i, ws_compression=compressed, tls=tls,
                                  journal_mb=bench.args.journal_segment_mb if journal else None)
        runs.append({**numbers, "awake_cpus": alternate or bench.args.awake_cpus == "on", "ws_compression": compressed,
                     "tls": tls})
        bench.report.update(e2e_400rps_20sym=max(runs, key=_tail), e2e_runs=runs)
        bench.progress(f"e2e run {i + 1}/{bench.counts.e2e_runs}: {line(runs[-1])}")


def _tail(numbers):
    """A run's rank for the headline: missed requests first, then the p99 (a run with no answer is the worst)."""
    return numbers["missed"], math.inf if numbers["p99_ms"] is None else numbers["p99_ms"]


def summary(data) -> list[str]:
    if "e2e_400rps_20sym" not in data:
        return []
    runs = data.get("e2e_runs", [])
    if len(runs) < 2:
        return [f"e2e 400 req/s, 20 symbols: {line(data['e2e_400rps_20sym'])}"]
    lines = [f"e2e 400 req/s, 20 symbols, run {i + 1}: {line(numbers)}" for i, numbers in enumerate(runs)]
    return lines + [f"e2e 400 req/s, 20 symbols (the worst run): {line(data['e2e_400rps_20sym'])}"]
