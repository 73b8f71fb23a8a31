"""The live leaderboard page and the end-of-run summary table."""
import html

REFRESH_S = 2

_COLUMNS = (  # (heading, key, format)
    ("Team", "team", "{}"),
    ("PnL", "pnl", "{:.3f}"),
    ("Recent PnL/s", "recent_pnl_per_s", "{:.3f}"),
    ("Accuracy", "accuracy", "{:.4f}"),
    ("p50 ms", "latency_p50_ms", "{:.1f}"),
    ("p99 ms", "latency_p99_ms", "{:.1f}"),
    ("Responses/s", "responses_per_s", "{:.1f}"),
    ("PnL/response", "pnl_per_response", "{:.4f}"),
    ("Responses", "responses", "{}"),
    ("Missed", "missed", "{}"),
    ("Errors", "errors", "{}"),
)


def leaderboard_row(summary: dict) -> dict:
    """The leaderboard's view of one team's summary."""
    row = {key: summary[key] for key in ("team", "pnl", "recent_pnl_per_s", "accuracy", "responses_per_s",
                                         "pnl_per_response", "responses", "missed", "errors", "duplicates",
                                         "requests", "connected")}
    row["latency_p50_ms"] = summary["latency_ms"]["p50"]
    row["latency_p99_ms"] = summary["latency_ms"]["p99"]
    return row


def _cell(fmt, value):
    return "-" if value is None else fmt.format(value)


def render_page(scores: dict) -> str:
    """A self-refreshing HTML page, rendered on the server so it needs no script."""
    head = "".join(f"<th>{html.escape(title)}</th>" for title, _, _ in _COLUMNS)
    rows = []
    for rank, team in enumerate(scores["teams"], 1):
        cells = "".join(f"<td>{html.escape(_cell(fmt, team[key]))}</td>" for _, key, fmt in _COLUMNS)
        rows.append(f'<tr class="team"><td>{rank}</td>{cells}</tr>')
    body = "\n".join(rows) or f'<tr><td colspan="{len(_COLUMNS) + 1}">no team has registered yet</td></tr>'
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>Leaderboard</title>
<style>body{{font-family:sans-serif}} table{{border-collapse:collapse}}
td,th{{padding:4px 10px;border-bottom:1px solid #ccc;text-align:right}} td:nth-child(2){{text-align:left}}</style>
</head><body><h1>Leaderboard</h1>
<p>{scores["stream"]["requests"]} requests over {scores["stream"]["symbols"]} symbols per team;
unregistered connections' errors: {scores["unregistered_errors"]}. Refreshes every {REFRESH_S} s;
raw data at <a href="/scores.json">/scores.json</a>.</p>
<table id="leaderboard"><thead><tr><th>#</th>{head}</tr></thead>
<tbody>
{body}
</tbody></table></body></html>
"""


def format_table(summaries: list[dict]) -> str:
    """Plain-text summary, one line per team."""
    headings = ("team", "requests", "responses", "missed", "errors", "dups", "accuracy",
                "p50 ms", "p99 ms", "resp/s", "pnl")
    lines = [headings]
    for s in summaries:
        lat = s["latency_ms"]
        lines.append((s["team"], str(s["requests"]), str(s["responses"]), str(s["missed"]), str(s["errors"]),
                      str(s["duplicates"]), f"{s['accuracy']:.4f}", _cell("{:.1f}", lat["p50"]),
                      _cell("{:.1f}", lat["p99"]), f"{s['responses_per_s']:.1f}", f"{s['pnl']:.3f}"))
    if len(lines) == 1:
        return "no team registered"
    widths = [max(len(line[i]) for line in lines) for i in range(len(headings))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
                     for line in lines)
