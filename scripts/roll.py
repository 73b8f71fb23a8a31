#!/usr/bin/env python
"""Roll a new version of the team client into team/, with a backup to return to.

    python scripts/roll.py CANDIDATE_DIR        # self-check, snapshot team/, then replace it
    python scripts/roll.py CANDIDATE_DIR --force  # replace even if the self-check fails
    python scripts/roll.py --list                 # snapshots, oldest first
    python scripts/roll.py --revert [NAME]        # restore a snapshot (newest by default)

Every replacement first copies team/ into backups/<UTC timestamp>/team/ with a manifest.json
(files and their sha256), and a revert snapshots the current team/ too, so a revert can be undone
by another revert. The self-check runs the candidate's ExampleModel.process_batch through
local_evaluator.py (tiny preset, reference engine) in a subprocess and wants every request
answered with within_atol 1.0 on every tower.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

from client import cli

DEFAULT_TEAM_DIR = REPO_ROOT / "team"
DEFAULT_BACKUPS_DIR = REPO_ROOT / "backups"
# Installed (pip install .), the defaults would be the package's own team/ in site-packages, which `fastens-team`
# runs, and backups beside it that pip uninstall leaves behind: there, both folders must be named.
INSTALLED = not (REPO_ROOT / "pyproject.toml").is_file()
EVALUATOR = REPO_ROOT / "local_evaluator.py"
MANIFEST = "manifest.json"
PROG = cli.prog_name("scripts/roll.py")
TOWERS = ("xlstm", "mamba2", "retnet", "hawk")
# Byte-code caches are rebuilt on import; copying them would only make manifests differ.
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")
CHECK_ARGS = ("--preset", "tiny", "--engine", "reference", "--device", "cpu",
              "--symbols", "3", "--requests", "24")


class RollError(cli.CliError):
    """A refused roll or revert; nothing was changed."""


def file_hashes(folder: Path) -> dict[str, str]:
    """{relative posix path: sha256} of every file under folder, caches excluded."""
    hashes = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
            hashes[relative.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def snapshot(team_dir: Path, backups_dir: Path, reason: str) -> Path:
    """Copy team_dir into backups_dir/<UTC timestamp>/team with a manifest; return the snapshot folder."""
    now = datetime.datetime.now(datetime.timezone.utc)
    backups_dir.mkdir(parents=True, exist_ok=True)
    base = now.strftime("%Y%m%dT%H%M%SZ")
    name, counter = base, 1
    while (backups_dir / name).exists():  # two snapshots within one second
        counter += 1
        name = f"{base}-{counter}"
    folder = backups_dir / name
    shutil.copytree(team_dir, folder / "team", ignore=IGNORED)
    manifest = {"name": name, "created": now.isoformat(), "reason": reason,
                "source": str(team_dir.resolve()), "files": file_hashes(folder / "team")}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def list_snapshots(backups_dir: Path) -> list[dict]:
    """Manifests of the snapshots in backups_dir, oldest first (folders without one are not snapshots)."""
    manifests = []
    if backups_dir.is_dir():
        for manifest_path in backups_dir.glob(f"*/{MANIFEST}"):
            try:
                manifest = json.loads(manifest_path.read_text())
                if not isinstance(manifest, dict):
                    raise ValueError("it is not a JSON object")
                missing = [key for key in ("name", "created", "reason", "files") if key not in manifest]
                if missing:
                    raise ValueError(f"it lacks {', '.join(missing)}")
                # else the sort, or the revert's comparison, failed as an unexpected error
                if not isinstance(manifest["created"], str) or not isinstance(manifest["files"], dict):
                    raise ValueError("its created is not text or its files not an object")
            except (OSError, ValueError) as exc:
                raise RollError(f"unreadable manifest {manifest_path}: {exc}") from exc
            # named by its folder, which revert restores: a snapshot renamed or copied keeps its manifest's name
            manifests.append(dict(manifest, name=manifest_path.parent.name))
    return sorted(manifests, key=lambda m: (m["created"], m["name"]))


def verify_snapshot(folder: Path) -> None:
    """Raise RollError if the snapshot's files differ from its manifest."""
    expected = json.loads((folder / MANIFEST).read_text())["files"]
    actual = file_hashes(folder / "team") if (folder / "team").is_dir() else {}
    if actual != expected:
        changed = sorted(p for p in expected.keys() & actual.keys() if expected[p] != actual[p])
        missing = sorted(expected.keys() - actual.keys())
        extra = sorted(actual.keys() - expected.keys())
        raise RollError(f"snapshot {folder.name} does not match its manifest (changed {changed}, "
                        f"missing {missing}, extra {extra}); refusing to restore it")


def replace_dir(source: Path, target: Path) -> None:
    """Make target a copy of source. The copy is staged beside target first, so a failed copy
    leaves target as it was."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.incoming-", dir=target.parent))
    try:
        shutil.copytree(source, staging / "tree", ignore=IGNORED)
        retired = staging / "retired"
        if target.exists():
            target.rename(retired)
        try:
            (staging / "tree").rename(target)
        except OSError:
            if retired.exists():
                retired.rename(target)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def self_check(candidate: Path, timeout_s: float = 600.0) -> str | None:
    """None when the candidate passes, else why it fails: it must import, have
    ExampleModel.process_batch, and answer a short tiny-preset evaluation within atol on every tower."""
    if not (candidate / "example_model.py").is_file():
        return f"{candidate} has no example_model.py"
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "check.json"
        # resolved: the evaluator runs in REPO_ROOT, where a path relative to the caller's folder means another
        command = [sys.executable, str(EVALUATOR), "--team-dir", str(candidate.resolve()), *CHECK_ARGS,
                   "--json", str(summary_path)]
        print(f"self-check: a short tiny-preset evaluation of {candidate} ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"the self-check evaluation did not finish within {timeout_s:g} s"
        if done.returncode != 0:  # the evaluator's last line says why
            last = ((done.stderr or done.stdout).strip().splitlines() or ["(no output)"])[-1]
            return f"the self-check evaluation failed (exit {done.returncode}): {last}"
        summary = json.loads(summary_path.read_text())
    if summary["responses"] != summary["requests"]:
        return f"answered {summary['responses']} of {summary['requests']} requests"
    off = {t: summary["towers"][t]["within_atol"] for t in TOWERS if summary["towers"][t]["within_atol"] != 1.0}
    if off:
        return f"predictions off the fp32 reference by more than {summary['atol']:g}: within_atol {off}"
    return None


def _check_backups_folder(team_dir: Path, backups_dir: Path) -> None:
    if backups_dir.resolve().is_relative_to(team_dir.resolve()):
        raise RollError(f"the backups folder {backups_dir} is inside the team folder {team_dir}: a snapshot would "
                        f"copy itself, and replacing the team folder would delete it; keep the backups outside")


def _check_candidate_folder(candidate: Path, team_dir: Path) -> None:
    if not candidate.is_dir():
        raise RollError(f"candidate {candidate} is not a folder")
    if team_dir.exists() and candidate.resolve() == team_dir.resolve():
        raise RollError(f"candidate {candidate} is the team folder itself")
    if team_dir.resolve().is_relative_to(candidate.resolve()):
        # its copy, staged beside the team folder, would copy itself until the path was too long
        raise RollError(f"the team folder {team_dir} is inside the candidate {candidate}: the new team folder would "
                        f"hold the old one; roll a folder that holds only the new team client")


def roll(candidate: Path, team_dir: Path = DEFAULT_TEAM_DIR, backups_dir: Path = DEFAULT_BACKUPS_DIR,
         force: bool = False, check=self_check) -> Path | None:
    """Self-check candidate (a failure refuses the roll unless force), snapshot team_dir, replace it.
    Returns the snapshot folder (None when there was no team_dir to snapshot)."""
    candidate, team_dir, backups_dir = Path(candidate), Path(team_dir), Path(backups_dir)
    _check_candidate_folder(candidate, team_dir)
    _check_backups_folder(team_dir, backups_dir)
    failure = check(candidate)
    if failure is not None:
        if not force:
            raise RollError(f"candidate {candidate} refused, {team_dir} untouched: {failure}\n"
                            f"(--force rolls it in anyway)")
        print(f"warning: self-check failed, rolling in anyway (--force): {failure}", file=sys.stderr)
    saved = snapshot(team_dir, backups_dir, f"before roll of {candidate.resolve()}") if team_dir.exists() else None
    replace_dir(candidate, team_dir)
    return saved


def revert(team_dir: Path = DEFAULT_TEAM_DIR, backups_dir: Path = DEFAULT_BACKUPS_DIR,
           name: str | None = None) -> tuple[str, Path | None]:
    """Restore snapshot `name` (newest when None) into team_dir, snapshotting team_dir first.
    Returns (restored name, snapshot of what team_dir held before)."""
    team_dir, backups_dir = Path(team_dir), Path(backups_dir)
    _check_backups_folder(team_dir, backups_dir)
    snapshots = [m["name"] for m in list_snapshots(backups_dir)]
    if not snapshots:
        raise RollError(f"no snapshots in {backups_dir}")
    if name is None:
        name = snapshots[-1]
    elif name not in snapshots:
        raise RollError(f"no snapshot {name!r} in {backups_dir}; have {', '.join(snapshots)}")
    folder = backups_dir / name
    verify_snapshot(folder)
    saved = snapshot(team_dir, backups_dir, f"before revert to {name}") if team_dir.exists() else None
    replace_dir(folder / "team", team_dir)
    return name, saved


def parse_args(argv=None):
    p = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("candidate", nargs="?", help="folder to roll in as the new team/")
    action.add_argument("--list", action="store_true", help="list snapshots, oldest first")
    action.add_argument("--revert", nargs="?", const="", metavar="NAME",
                        help="restore snapshot NAME (default: the newest)")
    p.add_argument("--force", action="store_true", help="roll in even if the self-check fails")
    p.add_argument("--team-dir", type=Path, default=DEFAULT_TEAM_DIR, help="default: team/ at the repo root")
    p.add_argument("--backups-dir", type=Path, default=DEFAULT_BACKUPS_DIR,
                   help="default: backups/ at the repo root")
    p.add_argument("--check-timeout", type=cli.positive_float, default=600.0, help="self-check time limit, seconds")
    args = p.parse_args(argv)
    if args.force and args.candidate is None:
        p.error("--force applies to rolling in a candidate only")
    if INSTALLED and (args.backups_dir == DEFAULT_BACKUPS_DIR or (args.team_dir == DEFAULT_TEAM_DIR and not args.list)):
        p.error(f"the installed package's team/ ({DEFAULT_TEAM_DIR}) is not rolled: run this in a checkout, or name "
                f"the folders with --team-dir and --backups-dir")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        snapshots = list_snapshots(args.backups_dir)
        if not snapshots:
            print(f"no snapshots in {args.backups_dir}")
        for m in snapshots:
            print(f"{m['name']:<20} {m['created']:<34} {len(m['files']):>3} files  {m['reason']}")
    elif args.revert is not None:
        name, saved = revert(args.team_dir, args.backups_dir, args.revert or None)
        print(f"{args.team_dir} restored from snapshot {name}"
              + (f"; what it held is saved as {saved.name}" if saved else ""))
    else:
        saved = roll(Path(args.candidate), args.team_dir, args.backups_dir, args.force,
                     check=lambda candidate: self_check(candidate, args.check_timeout))
        print(f"{args.team_dir} now holds {args.candidate}"
              + (f"; the previous version is saved as {saved.name}" if saved else ""))
    return cli.EXIT_OK


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
