"""A stream file's own targets: the evaluator and the server say whether they match the chosen weights' model, and
--targets file|model chooses what is scored."""
import asyncio
import json

import numpy as np
import pytest

import local_evaluator as le
from client import cli
from client.model import load_model
from client.runtime import StreamingClient
from client.streams import Stream, generate_stream, save_stream
from client.targets import compute_targets
from server import ScoringServer, ServerConfig
from server.__main__ import parse_args
from server.leaderboard import render_page
from test_original_protocol import Oracle

TOWERS = ("xlstm", "mamba2", "retnet", "hawk")


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """(folder, model targets) with streams of the tiny model's seed-0 targets: matching.npz (the model's),
    differing.npz (xLSTM's off by 2e-3 on every other request) and bare.npz (none)."""
    folder = tmp_path_factory.mktemp("streams")
    stream = generate_stream(3, 24, seed=5)
    model, fingerprint = load_model("tiny", seed=0)
    model_targets = compute_targets(model, stream, fingerprint, device="cpu", cache_dir=folder / "cache",
                                    progress=False)
    differing = model_targets.copy()
    differing[::2, 0] += 2e-3
    for name, targets in (("matching", model_targets), ("differing", differing), ("bare", None)):
        save_stream(Stream(stream.symbols, stream.features, stream.delay_ms, targets), folder / f"{name}.npz")
    return folder, model_targets


def evaluate(capsys, folder, name, *argv):
    out = folder / f"{name}-{'-'.join(argv)}.json"
    rc = cli.run_cli(le.main, le.PROG, ["--stream", str(folder / f"{name}.npz"), "--preset", "tiny", "--device",
                                        "cpu", "--cache-dir", str(folder / "cache"), "--json", str(out), *argv])
    err = capsys.readouterr().err
    return rc, err, json.loads(out.read_text()) if rc == 0 else None


def test_the_evaluator_says_whether_a_files_targets_match_the_model(streams, capsys):
    folder, _ = streams
    rc, err, summary = evaluate(capsys, folder, "matching")
    assert rc == 0, err
    assert ("local_evaluator.py: the stream's own targets match the model (preset tiny, seed 0) within atol 0.001 "
            "(max |file - model|: xlstm 0.0e+00, mamba2 0.0e+00, retnet 0.0e+00, hawk 0.0e+00); scoring against "
            "the model's (--targets file to score against the file's)") in err
    assert summary["targets"]["source"] == "model" and summary["targets"]["file_vs_model"]["match"] is True


def test_targets_file_scores_against_a_files_own_targets_that_differ(streams, capsys):
    folder, _ = streams
    rc, err, by_model = evaluate(capsys, folder, "differing")
    assert rc == 0, err
    assert "the stream's own targets differ from the model (preset tiny, seed 0): 87.5% within atol 0.001, worst " \
           "on xlstm; other weights made them (max |file - model|: xlstm 2.0e-03, mamba2 0.0e+00" in err
    assert err.count("scoring against the model's (--targets file to score against the file's)") == 1
    assert all(by_model["towers"][t]["within_atol"] == 1.0 for t in TOWERS)
    rc, err, by_file = evaluate(capsys, folder, "differing", "--targets", "file")
    assert rc == 0, err
    assert "scoring against the file's (--targets model to score against the model's)" in err
    assert by_file["towers"]["xlstm"]["within_atol"] == 0.5 and by_file["towers"]["hawk"]["within_atol"] == 1.0
    comparison = by_file["targets"]["file_vs_model"]
    assert by_file["targets"]["source"] == "file" and comparison["match"] is False
    assert comparison["max_abs_diff"]["xlstm"] == pytest.approx(2e-3, rel=1e-3)


def test_targets_file_without_targets_in_the_stream_is_one_line(streams, capsys):
    folder, _ = streams
    rc, err, _ = evaluate(capsys, folder, "bare", "--targets", "file")
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        "local_evaluator.py: error: --targets file: the stream carries no targets")


def test_the_server_scores_a_files_own_targets_and_says_how_far_they_are(streams):
    folder, model_targets = streams

    async def main():
        server = ScoringServer(ServerConfig(preset="tiny", seed=0, stream=str(folder / "differing.npz"),
                                            targets="file", rate=500.0, cache_dir=str(folder / "cache")))
        port = await server.start()
        file_targets = np.load(folder / "differing.npz")["targets"]
        summary = await StreamingClient(Oracle(file_targets), f"tcp://127.0.0.1:{port}", "x",
                                        leave_at_end=True).run()
        scores = server.scores()
        await server.stop()
        return summary, scores

    summary, scores = asyncio.run(asyncio.wait_for(main(), 60))
    assert summary["accuracy"] == 1.0 and summary["responses"] == 24  # the file's targets are what is scored
    assert scores["targets"]["source"] == "file" and scores["targets"]["file_vs_model"]["match"] is False
    assert ("Targets: the stream file's own; the file's own differ from the model's (max difference 2.0e-03, "
            "atol 0.001).") in render_page(scores)


def test_the_server_wants_a_stream_for_targets_file(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--targets", "file"])
    assert "--targets file needs --stream, a file that carries targets" in capsys.readouterr().err
    assert parse_args(["--stream", __file__, "--targets", "file"]).targets == "file"


def test_targets_that_differ_in_one_row_of_ten_thousand_never_read_as_all_within():
    from client.targets import compare_targets, describe_targets

    model = np.zeros((10_000, 4), np.float32)
    file = model.copy()
    file[0, 0] = 2e-3  # 39,999 of 40,000 within: rounded to nearest, 100.0%
    line = describe_targets(compare_targets(file, model, 1e-3), "model", "preset tiny, seed 0")
    assert "differ from the model (preset tiny, seed 0): 99.9% within atol 0.001" in line, line
