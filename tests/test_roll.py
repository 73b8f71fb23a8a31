"""scripts/roll.py: roll/revert round trips, the self-check gate, --force, and bad input."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from client import cli

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("roll", REPO_ROOT / "scripts" / "roll.py")
roll = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roll)


def passes(candidate):
    return None


def write_tree(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTENS_CACHE", str(tmp_path / "cache"))  # the self-check's targets
    team = write_tree(tmp_path / "team", {"example_model.py": "# original\n", "notes/a.txt": "v1"})
    candidate = write_tree(tmp_path / "candidate", {"example_model.py": "# candidate\n", "b.txt": "new"})
    return team, candidate, tmp_path / "backups"


def test_roll_then_revert_round_trips(dirs):
    team, candidate, backups = dirs
    original = roll.file_hashes(team)
    (team / "__pycache__").mkdir()
    (team / "__pycache__" / "x.pyc").write_bytes(b"cache")

    saved = roll.roll(candidate, team, backups, check=passes)
    assert roll.file_hashes(team) == roll.file_hashes(candidate)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["files"] == original  # caches are not part of a snapshot
    assert [m["name"] for m in roll.list_snapshots(backups)] == [saved.name]

    restored, undo = roll.revert(team, backups)
    assert restored == saved.name
    assert roll.file_hashes(team) == original
    assert [m["name"] for m in roll.list_snapshots(backups)] == [saved.name, undo.name]

    # the revert itself is undone by reverting to the snapshot it took
    assert roll.revert(team, backups)[0] == undo.name
    assert roll.file_hashes(team) == roll.file_hashes(candidate)
    # and any older snapshot can be named
    roll.revert(team, backups, saved.name)
    assert roll.file_hashes(team) == original


def test_cli_list_and_revert(dirs, capsys):
    team, candidate, backups = dirs
    saved = roll.roll(candidate, team, backups, check=passes)
    common = ["--team-dir", str(team), "--backups-dir", str(backups)]
    assert roll.main(["--list", *common]) == 0
    out = capsys.readouterr().out
    assert saved.name in out and "before roll of" in out and "2 files" in out
    assert roll.main(["--revert", saved.name, *common]) == 0
    assert f"restored from snapshot {saved.name}" in capsys.readouterr().out
    assert (team / "notes" / "a.txt").read_text() == "v1"


def test_broken_candidate_is_refused_and_team_untouched_unless_forced(dirs):
    team, candidate, backups = dirs
    (candidate / "example_model.py").write_text("def broken(:\n")
    before = roll.file_hashes(team)
    with pytest.raises(roll.RollError, match="(?s)refused.*SyntaxError"):
        roll.roll(candidate, team, backups)
    assert roll.file_hashes(team) == before
    assert roll.list_snapshots(backups) == []

    saved = roll.roll(candidate, team, backups, force=True)
    assert roll.file_hashes(team) == roll.file_hashes(candidate)
    assert json.loads((saved / "manifest.json").read_text())["files"] == before


def test_inaccurate_candidate_is_refused(dirs):
    team, candidate, _ = dirs
    shutil.copy(REPO_ROOT / "team" / "example_model.py", candidate / "example_model.py")
    with (candidate / "example_model.py").open("a") as source:
        source.write("\n_exact = ExampleModel.process_batch\n"
                     "def _off(self, requests):\n"
                     "    response = _exact(self, requests)\n"
                     "    response['predictions'] = response['predictions'] + 0.01\n"
                     "    return response\n"
                     "ExampleModel.process_batch = _off\n")
    failure = roll.self_check(candidate)
    assert failure is not None and "within_atol" in failure and "xlstm" in failure


def test_a_copy_of_the_real_team_client_passes_through_the_cli(dirs):
    team, candidate, backups = dirs
    shutil.rmtree(candidate)
    shutil.copytree(REPO_ROOT / "team", candidate, ignore=roll.IGNORED)
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "roll.py"), str(candidate),
                           "--team-dir", str(team), "--backups-dir", str(backups)],
                          capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert roll.file_hashes(team) == roll.file_hashes(candidate)
    assert len(roll.list_snapshots(backups)) == 1


def test_a_relative_candidate_is_checked_where_it_is(dirs, monkeypatch):
    _, candidate, _ = dirs
    shutil.copy(REPO_ROOT / "team" / "example_model.py", candidate / "example_model.py")
    monkeypatch.chdir(candidate.parent)
    assert roll.self_check(Path(candidate.name)) is None


def test_candidate_without_example_model_fails_the_check(tmp_path):
    assert "has no example_model.py" in roll.self_check(tmp_path)


@pytest.mark.parametrize("which, message", [("missing", "is not a folder"), ("team", "the team folder itself")])
def test_bad_candidate_folder(dirs, which, message):
    team, candidate, backups = dirs
    target = candidate.parent / "nowhere" if which == "missing" else team
    with pytest.raises(roll.RollError, match=message):
        roll.roll(target, team, backups, check=passes)


def test_backups_inside_the_team_folder_are_refused(dirs):
    """A snapshot of team/ into team/backups copied itself into itself until the path was too long."""
    team, candidate, _ = dirs
    before = roll.file_hashes(team)
    for backups in (team / "backups", team):
        with pytest.raises(roll.RollError, match="is inside the team folder"):
            roll.roll(candidate, team, backups, check=passes)
        with pytest.raises(roll.RollError, match="is inside the team folder"):
            roll.revert(team, backups)
    assert roll.file_hashes(team) == before and not (team / "backups").exists()


def test_a_candidate_holding_the_team_folder_is_refused(tmp_path):
    """Its copy, staged beside team/ and so inside the candidate, copied itself until the path was too long, after
    the team folder had been snapshotted."""
    candidate = write_tree(tmp_path / "candidate", {"example_model.py": "# candidate\n"})
    team = write_tree(candidate / "team", {"example_model.py": "# original\n"})
    with pytest.raises(roll.RollError, match="is inside the candidate"):
        roll.roll(candidate, team, tmp_path / "backups", check=passes)
    assert sorted(p.name for p in candidate.iterdir()) == ["example_model.py", "team"]
    assert not (tmp_path / "backups").exists()


def test_revert_without_snapshots_or_with_an_unknown_name(dirs):
    team, candidate, backups = dirs
    with pytest.raises(roll.RollError, match="no snapshots"):
        roll.revert(team, backups)
    saved = roll.roll(candidate, team, backups, check=passes)
    with pytest.raises(roll.RollError, match=f"no snapshot 'nope'.*have {saved.name}"):
        roll.revert(team, backups, "nope")


def test_a_renamed_or_copied_snapshot_is_listed_and_restored_by_its_folder_name(dirs):
    """--list showed the manifest's name: a snapshot renamed could not be restored by either name ("No such file or
    directory: .../manifest.json"), nor a copy by its own."""
    team, candidate, backups = dirs
    saved = roll.roll(candidate, team, backups, check=passes)
    shutil.copytree(saved, backups / "good")
    saved.rename(backups / "renamed")
    assert sorted(m["name"] for m in roll.list_snapshots(backups)) == ["good", "renamed"]
    assert roll.revert(team, backups, "renamed")[0] == "renamed"
    assert roll.file_hashes(team) == roll.file_hashes(backups / "good" / "team")
    assert roll.revert(team, backups, "good")[0] == "good"


def test_a_corrupted_snapshot_is_not_restored(dirs):
    team, candidate, backups = dirs
    saved = roll.roll(candidate, team, backups, check=passes)
    (saved / "team" / "notes" / "a.txt").write_text("tampered")
    before = roll.file_hashes(team)
    with pytest.raises(roll.RollError, match=r"does not match its manifest \(changed \['notes/a.txt'\]"):
        roll.revert(team, backups)
    assert roll.file_hashes(team) == before
    assert len(roll.list_snapshots(backups)) == 1


def test_a_malformed_manifest_is_reported(dirs):
    team, candidate, backups = dirs
    saved = roll.roll(candidate, team, backups, check=passes)
    (saved / "manifest.json").write_text('{"name": "x"}')
    with pytest.raises(roll.RollError, match="unreadable manifest.*lacks created"):
        roll.list_snapshots(backups)
    # these were unexpected errors (exit 1): the sort's TypeError, the revert's AttributeError
    for text, message in (('["x"]', "it is not a JSON object"),
                          ('{"name": "x", "created": null, "reason": "r", "files": {}}', "its created is not text"),
                          ('{"name": "x", "created": "c", "reason": "r", "files": []}', "its files not an object")):
        (saved / "manifest.json").write_text(text)
        with pytest.raises(roll.RollError, match=f"unreadable manifest.*{message}"):
            roll.revert(team, backups)


def test_cli_errors(dirs, capsys):
    team, candidate, backups = dirs
    argv = ["--revert", "--team-dir", str(team), "--backups-dir", str(backups)]
    assert cli.run_cli(roll.main, "scripts/roll.py", argv) == 2
    assert capsys.readouterr().err == f"scripts/roll.py: error: no snapshots in {backups}\n"
    with pytest.raises(SystemExit):
        roll.main(["--list", "--force"])
    assert "--force applies to rolling in a candidate only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        roll.main([])
    with pytest.raises(SystemExit):
        roll.main([str(candidate), "--check-timeout", "-1"])
    assert "argument --check-timeout: must be a positive number, got '-1'" in capsys.readouterr().err


def test_a_refused_candidate_is_one_line_through_the_cli(dirs):
    team, candidate, backups = dirs
    (candidate / "example_model.py").write_text("def broken(:\n")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "roll.py"), str(candidate),
                           "--team-dir", str(team), "--backups-dir", str(backups)],
                          capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 2 and "Traceback" not in done.stderr
    status, error = done.stderr.strip().splitlines()
    assert status.startswith("self-check: a short tiny-preset evaluation of ")
    assert error.startswith(f"scripts/roll.py: error: candidate {candidate} refused, {team} untouched: the "
                            f"self-check evaluation failed (exit 2): local_evaluator.py: error: importing ")
    assert "SyntaxError" in error and error.endswith("(--force rolls it in anyway)")


def test_installed_the_package_team_folder_is_rolled_only_when_named(monkeypatch, usage_error, tmp_path):
    """pip-installed, the default team/ is the package's own in site-packages (what fastens-team runs), with backups
    beside it that pip uninstall leaves: each must be named."""
    monkeypatch.setattr(roll, "INSTALLED", True)
    for argv in (["cand"], ["--revert"], ["--list"], ["cand", "--team-dir", str(tmp_path / "team")]):
        assert "the installed package's team/" in usage_error(roll.parse_args, argv)
    named = ["--team-dir", str(tmp_path / "team"), "--backups-dir", str(tmp_path / "backups")]
    assert roll.parse_args(["cand", *named]).candidate == "cand"
    assert roll.parse_args(["--list", "--backups-dir", str(tmp_path / "backups")]).list
