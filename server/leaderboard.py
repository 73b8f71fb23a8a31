"""The live leaderboard page and the end-of-run summary table."""
import html

from client.protocol import CLIENT_NOTICES

REFRESH_S = 2
# A team is marked when its accuracy is under this fraction of the best other team's (or of 1.0, what the
# reference itself scores, when it plays alone): other weights or a broken client, not a slower one.
FAR_BELOW_RATIO = 0.5

_NUMBER_COLUMNS = (  # (heading, key, format)
    ("PnL", "pnl", "{:.3f}"),
    ("Recent PnL/s", "recent_pnl_per_s", "{:.3f}"),
    ("Accuracy", "accuracy", "{:.4f}"),
    ("p50 ms", "latency_p50_ms", "{:.1f}"),
    ("p99 ms", "latency_p99_ms", "{:.1f}"),
    ("Responses/s", "responses_per_s", "{:.1f}"),
    ("Responses", "responses", "{}"),
    ("Missed", "missed", "{}"),
    ("Errors", "errors", "{}"),
)
_HEADINGS = ("#", "Team", "State", "Sent", "Weights", *(title for title, _, _ in _NUMBER_COLUMNS), "Note")


def leaderboard_row(summary: dict) -> dict:
    """The leaderboard's view of one team's summary."""
    row = {key: summary[key] for key in ("team", "pnl", "recent_pnl_per_s", "accuracy", "responses_per_s",
                                         "pnl_per_response", "responses", "missed", "errors", "duplicates",
                                         "requests", "total_requests", "connected", "state",
                                         "weights_fingerprint", "weights_match", "notices", "notices_total")}
    row["latency_p50_ms"] = summary["latency_ms"]["p50"]
    row["latency_p99_ms"] = summary["latency_ms"]["p99"]
    return row


def mark_far_below(rows: list[dict]) -> list[dict]:
    """Set each row's far_below: it has answered, and its accuracy is under FAR_BELOW_RATIO of the best
    other team's (of 1.0 when no other team has answered)."""
    for row in rows:
        others = [other["accuracy"] for other in rows if other is not row and other["responses"]]
        reference = max(others, default=1.0)
        row["far_below"] = bool(row["responses"]) and row["accuracy"] < FAR_BELOW_RATIO * reference
    return rows


def _cell(fmt, value):
    return "-" if value is None else fmt.format(value)


def _weights_cell(row, server_fingerprint):
    match = row["weights_match"]
    if match is None:
        return '<td class="unknown" title="the client did not send its weights fingerprint">not said</td>'
    title = html.escape(f"client {row['weights_fingerprint']}, server {server_fingerprint}")
    return (f'<td class="ok" title="{title}">match</td>' if match else
            f'<td class="bad" title="{title}">differ</td>')


def _note(row):
    notes = []
    if row["far_below"]:
        notes.append("accuracy far below")
    if row["weights_match"] is False:
        notes.append("other weights")
    if row["notices"]:  # what the client said of its play: the latest in full, with how many
        latest = row["notices"][-1]
        count = f" ({row['notices_total']} notices)" if row["notices_total"] > 1 else ""
        notes.append(f"{CLIENT_NOTICES.get(latest['code'], latest['code'])}{count}: {latest['text']}")
    return "; ".join(notes)


def _team_row(rank, row, server_fingerprint):
    sent, total = row["requests"], row["total_requests"]
    numbers = []
    for _, key, fmt in _NUMBER_COLUMNS:
        text = html.escape(_cell(fmt, row[key]))
        if key == "accuracy" and row["far_below"]:
            numbers.append(f'<td class="bad" title="under {FAR_BELOW_RATIO:g} x the best other team\'s">'
                           f'&#9888; {text}</td>')
        else:
            numbers.append(f"<td>{text}</td>")
    return (f'<tr class="team{" far-below" if row["far_below"] else ""}"><td>{rank}</td>'
            f'<td>{html.escape(row["team"])}</td><td class="{row["state"]}">{row["state"]}</td>'
            f'<td><progress value="{sent}" max="{total}"></progress> {sent}/{total}</td>'
            f'{_weights_cell(row, server_fingerprint)}{"".join(numbers)}'
            f'<td class="note">{html.escape(_note(row))}</td></tr>')


def _targets_sentence(targets: dict) -> str:
    """Which targets are scored, when the stream file carries its own (else the model's, as the page says)."""
    comparison = targets.get("file_vs_model")
    if comparison is None:
        return ""
    worst = max(comparison["max_abs_diff"].values())
    agreement = "match" if comparison["match"] else "differ from"
    whose = "the stream file's own" if targets["source"] == "file" else "this model's"
    return (f" Targets: {whose}; the file's own {agreement} the model's (max difference {worst:.1e}, atol "
            f"{comparison['atol']:g}).")


def render_page(scores: dict) -> str:
    """A self-refreshing HTML page, rendered on the server so it needs no script."""
    model, stream, scoring = scores["model"], scores["stream"], scores["scoring"]
    head = "".join(f"<th>{html.escape(title)}</th>" for title in _HEADINGS)
    rows = [_team_row(rank, row, model["weights_fingerprint"]) for rank, row in enumerate(scores["teams"], 1)]
    body = "\n".join(rows) or f'<tr><td colspan="{len(_HEADINGS)}">no team has registered yet</td></tr>'
    weights = model["weights_fingerprint"] or "not known"
    targets = _targets_sentence(scores["targets"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>Leaderboard</title>
<style>body{{font-family:sans-serif;margin:1em 2em}} table{{border-collapse:collapse}}
td,th{{padding:4px 8px;border-bottom:1px solid #ccc;text-align:right;white-space:nowrap}}
td:nth-child(2),td:nth-child(3),th:nth-child(2),th:nth-child(3),th:last-child{{text-align:left}} progress{{width:5em}}
td.note{{text-align:left;white-space:normal;max-width:40em}}
.ok,.finished{{color:#070}} .playing{{color:#05a}} .disconnected,.unknown{{color:#777}}
.bad{{color:#b00;font-weight:bold}} tr.far-below{{background:#fee}} p{{max-width:60em}}</style>
</head><body><h1>Leaderboard</h1>
<p id="model">Model: preset {html.escape(model["preset"])}, weights {html.escape(weights)}.{targets} Each team
plays {stream["requests"]} requests over {stream["symbols"]} symbols.</p>
<p id="pnl">PnL: each request answered within {scoring["timeout_s"]:g} s earns (correct towers / 4) &times;
0.5<sup>latency ms / {scoring["half_life_ms"]:g}</sup>, a tower being correct within {scoring["atol"]:g} of the
reference model, and a missed request earns 0; a team's PnL is the sum over its requests.</p>
<table id="leaderboard"><thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody></table>
<p>Sent: requests sent of the stream. Weights: whether the team's weights fingerprint is the server's.
&#9888; marks an accuracy under {FAR_BELOW_RATIO:g} &times; the best other team's. Unregistered connections'
errors: {scores["unregistered_errors"]}. Refreshes every {REFRESH_S} s; raw data at
<a href="/scores.json">/scores.json</a>.</p></body></html>
"""


def format_table(summaries: list[dict]) -> str:
    """Plain-text summary, one line per team."""
    headings = ("team", "requests", "responses", "missed", "errors", "dups", "accuracy",
                "p50 ms", "p99 ms", "resp/s", "pnl", "state", "weights")
    lines = [headings]
    for s in summaries:
        lat = s["latency_ms"]
        weights = {True: "match", False: "differ", None: "-"}[s["weights_match"]]
        lines.append((s["team"], str(s["requests"]), str(s["responses"]), str(s["missed"]), str(s["errors"]),
                      str(s["duplicates"]), _cell("{:.4f}", s["accuracy"]), _cell("{:.1f}", lat["p50"]),
                      _cell("{:.1f}", lat["p99"]), f"{s['responses_per_s']:.1f}", f"{s['pnl']:.3f}",
                      s["state"], weights))
    if len(lines) == 1:
        return "no team registered"
    widths = [max(len(line[i]) for line in lines) for i in range(len(headings))]
    table = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
             for line in lines]
    for s in summaries:  # what each client said of its play beyond its answers
        table += [f"{s['team']}: {CLIENT_NOTICES.get(n['code'], n['code'])}: {n['text']}" for n in s["notices"]]
        if s["notices_total"] > len(s["notices"]):
            table.append(f"{s['team']}: ... {s['notices_total'] - len(s['notices'])} notices more")
    return "\n".join(table)
