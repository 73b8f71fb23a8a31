"""docs/: every page the code cites is there, and every page links only to pages that are there."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITED = re.compile(r"docs/[\w/]+\.md|docs/model/")


def _code_files():
    for folder in ("client", "kernels", "server", "team", "scripts", "tests"):
        yield from (REPO / folder).rglob("*.py")
    yield REPO / "local_evaluator.py"


def test_every_cited_page_exists():
    cited = {(path, match) for path in _code_files() for match in CITED.findall(path.read_text())}
    assert cited, "the code cites docs/"
    missing = [f"{path.relative_to(REPO)}: {page}" for path, page in cited if not (REPO / page).exists()]
    assert not missing, missing


def test_links_between_pages_resolve():
    for page in (REPO / "docs").rglob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}"
