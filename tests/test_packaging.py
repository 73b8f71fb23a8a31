"""The source distribution, built as pip builds it: what a stranger unpacks must hold what the README runs there."""
import subprocess
import sys
import tarfile
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
