"""Stalls of the host itself: one process per CPU, pinned there, spins on the clock and records every gap longer
than --gap-ms between two reads. A process alone on its CPU sees a gap only when the CPU was taken from it (by the
kernel's own work, an interrupt storm, or, in a virtual machine, the hypervisor running something else), so gaps
here are stalls no change in the client can avoid. bench/LOG.md section 49 reads it beside the e2e section's tail.

    python scripts/host_hiccups.py --seconds 20 --json hiccups.json
"""
import json
import multiprocessing
import os
import sys
import time

from client import cli

PROG = "scripts/host_hiccups.py"

def spin(cpu, seconds, gap_ns, queue):
    """Spin on `cpu` for `seconds`: (cpu, [(gap start, gap end)] in ns of the monotonic clock for the gaps over
    gap_ns, the longest gap in ms)."""
    os.sched_setaffinity(0, {cpu})
    gaps, longest = [], 0
    now = time.monotonic_ns()
    end = now + int(seconds * 1e9)
    while now < end:
        then, now = now, time.monotonic_ns()
        gap = now - then
        longest = max(longest, gap)
        if gap > gap_ns:
            gaps.append((then, now))
    queue.put((cpu, gaps, longest / 1e6))


def shared_gaps(gaps_by_cpu) -> int:
    """Gaps that overlap a gap on at least half of the other CPUs: the whole machine stopped, not one CPU taken."""
    shared = 0
    for cpu, gaps in gaps_by_cpu.items():
        others = [other for other in gaps_by_cpu.values() if other is not gaps]
        for start, end in gaps:
            overlapping = sum(any(s < end and start < e for s, e in other) for other in others)
            shared += bool(others) and overlapping * 2 >= len(others)
    return shared


def steal_ms() -> dict[int, float]:
    """{cpu: ms} of time the hypervisor ran something else while this CPU wanted to run (/proc/stat's steal
    column, in clock ticks of 10 ms on most kernels); {} where the kernel does not say (no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    steal = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(fields) >= 8:
            steal[int(name[3:])] = int(fields[7]) * tick_ms
    return steal


def measure(seconds, gap_ms, cpus=None):
    """({cpu: {"gaps": n, "gap_ms_total": ..., "longest_ms": ..., "steal_ms": ... (None where not known)}} over the
    CPUs this process may run on, the gaps shared by at least half of the CPUs)."""
    cpus = sorted(cpus or os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=spin, args=(cpu, seconds, int(gap_ms * 1e6), queue)) for cpu in cpus]
    steal_before = steal_ms()
    for p in procs:
        p.start()
    results, gaps_by_cpu = {}, {}
    for _ in procs:
        cpu, gaps, longest = queue.get()
        gaps_by_cpu[cpu] = gaps
        results[cpu] = {"gaps": len(gaps), "gap_ms_total": round(sum(end - start for start, end in gaps) / 1e6, 3),
                        "longest_ms": round(longest, 3)}
    for p in procs:
        p.join()
    steal_after = steal_ms()
    for cpu, row in results.items():
        known = cpu in steal_before and cpu in steal_after
        row["steal_ms"] = round(steal_after[cpu] - steal_before[cpu], 1) if known else None
    return dict(sorted(results.items())), shared_gaps(gaps_by_cpu)


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=cli.positive_float, default=20.0)
    parser.add_argument("--gap-ms", type=cli.positive_float, default=0.5, help="gaps longer than this are counted")
    parser.add_argument("--json", type=cli.output_file, help="write the per-CPU results here")
    args = parser.parse_args(argv)
    results, shared = measure(args.seconds, args.gap_ms)
    print(f"{'cpu':>4} {'gaps':>6} {'total ms':>9} {'longest ms':>10} {'steal ms':>9}")
    for cpu, row in results.items():
        steal = "-" if row["steal_ms"] is None else f"{row['steal_ms']:.0f}"
        print(f"{cpu:>4} {row['gaps']:>6} {row['gap_ms_total']:>9.2f} {row['longest_ms']:>10.3f} {steal:>9}")
    worst = max(row["longest_ms"] for row in results.values())
    print(f"{len(results)} CPUs over {args.seconds:g} s: {sum(r['gaps'] for r in results.values())} gaps over "
          f"{args.gap_ms:g} ms, the longest {worst:.3f} ms; {shared} of them overlap a gap on half of the other CPUs "
          f"or more (the whole machine stopped); the hypervisor's steal "
          f"{sum(r['steal_ms'] or 0 for r in results.values()):.0f} ms in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": args.seconds, "gap_ms": args.gap_ms, "shared_gaps": shared, "cpus": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
