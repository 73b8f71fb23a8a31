"""Section compile: the torch.compile'd step against the hand-fused one (scripts/compile_bench.py)."""
import json

from scripts.benchmarks.harness import SHORT_BATCHES


def run(bench):
    from scripts.compile_bench import measure_compile

    bench.close_engine()  # its children build their own engines on this GPU
    bench.report.update(compile=measure_compile(bench.args.preset, bench.args.seed, bench.device,
                                                batches=SHORT_BATCHES))


def summary(data) -> list[str]:
    return [f"compile: {json.dumps(data['compile'])[:600]}"] if "compile" in data else []
