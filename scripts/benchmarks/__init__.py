"""scripts/bench.py's sections, one module each (run(bench) measures and records, summary(data) gives the summary
table's lines), over the shared harness (harness.py, serving.py, awake_cpus.py) and report (report.py)."""
from scripts.benchmarks import (accuracy, backlog, baseline, capacity, churn, compile, copy, e2e, floor, gpus,
                                hung, maxrate, precisions, shards, state_dtypes, state_rates, step, swap)

# In the order that shares work sensibly: a run's sections always go in this order.
SECTIONS = {"copy": copy, "step": step, "baseline": baseline, "accuracy": accuracy, "precisions": precisions,
            "state_dtypes": state_dtypes, "compile": compile, "e2e": e2e, "floor": floor, "backlog": backlog,
            "maxrate": maxrate, "state_rates": state_rates, "churn": churn, "capacity": capacity, "swap": swap,
            "gpus": gpus, "shards": shards, "hung": hung}
