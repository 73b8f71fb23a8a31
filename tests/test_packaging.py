"""The source distribution, built as pip builds it: what a stranger unpacks must hold what the README runs there."""
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from test_readme import cited_paths

ROOT = Path(__file__).resolve().parent.parent


def test_the_sdist_holds_the_tests_docs_and_requirements_and_what_the_readme_cites(tmp_path):
    # setuptools' own backend, without build isolation: nothing to download
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / done.stdout.strip().splitlines()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {path.relative_to(ROOT).as_posix() for folder in ("tests", "docs") for path in (ROOT / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts}
    # the README's measurements (bench/) and CI script: test_readme checks that each path it cites is there
    wanted |= {path.rstrip("/") for path in cited_paths()}
    missing = sorted(wanted - names) + [name for name in ("pytest.ini", "requirements.txt") if name not in names]
    assert not missing, f"not in the sdist: {missing}"


def test_the_websockets_the_package_allows_is_one_it_works_with():
    # >=13 let pip keep websockets 13.0-16.x: 13.0 has no Server.connections (the server failed at its stop), below
    # 14.2 a handshake cut short raised a bare EOFError, which the client took for a bug, and below 17.0 a stranger's
    # request with two Upgrade headers logged a traceback at the server (tests/test_tls.py, test_hostile.py,
    # test_server.py fail under them; all of them pass under 17.0)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = [requirement.split(">=", 1)[1] for requirement in project["dependencies"]
              if requirement.startswith("websockets>=")]
    assert floors and tuple(int(part) for part in floors[0].split(".")) >= (17,), project["dependencies"]
