"""Section accuracy: the engine against the fp32 reference on every input family (client/accuracy.py), with one
request of each symbol per step and with a backlog of --max-requests-per-symbol requests of every symbol in every
step."""
from client.accuracy import format_table


def run(bench):
    if not bench.args.accuracy_backlog_only:
        result = bench.suite.measure(bench.engine, prefix="ACC/")
        bench.report.update(accuracy=result)
        bench.progress("accuracy suite:\n" + format_table(result))
    k = bench.args.max_requests_per_symbol
    if k > 1:
        several = {"requests_per_symbol": k, **bench.suite.measure(bench.engine, prefix=f"ACC{k}/", per_symbol=k)}
        bench.report.update(accuracy_backlog=several)
        bench.progress(f"accuracy suite, {k} requests of every symbol a step:\n" + format_table(several))


def summary(data) -> list[str]:
    lines = []
    if "accuracy" in data:
        lines += ["accuracy suite (within 1e-3 and max error per tower, per input family):",
                  format_table(data["accuracy"])]
    if "accuracy_backlog" in data:
        lines += [f"accuracy suite, {data['accuracy_backlog']['requests_per_symbol']} requests of every symbol a step:",
                  format_table(data["accuracy_backlog"])]
    return lines
