"""The documentation stays in step with the files it describes: every file in docs/results/ has
one row in the index of docs/results.md (date and GPU as its name says, a status that is
"current" or points at a current file), every relative link in README.md, docs/ (results files
included) and studies/README.md resolves, every figure of the README's headline table and of
docs/results.md's table of the latest figures has a GPU, a date and a results file, and the
README still carries the commands CI runs. CPU only, standard library only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_MD = ROOT / "docs" / "results.md"
RESULTS_DIR = ROOT / "docs" / "results"

# Files written on another branch that a doc may link to before it merges (such a link dangles
# until then), as "docs/dispatch.md" and "studies/README.md" were in issue 27. An entry whose
# file exists fails test_pending_exemptions_name_no_existing_file: the exemption has outlived
# its reason, and would hide the file's later loss.
PENDING: set[str] = set()

GPU_OF_NAME = {"h100": "H100", "h200": "H200", "cpu": "CPU"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _table(text: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first markdown table after `heading`."""
    lines = text.splitlines()
    start = lines.index(heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= {"-", " ", ":"} for c in cells):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header row


def _index() -> dict[str, dict[str, str]]:
    rows = _table(RESULTS_MD.read_text(), "## Index of results/")
    index: dict[str, dict[str, str]] = {}
    for cells in rows:
        assert len(cells) == 6, f"index row with {len(cells)} cells: {cells}"
        m = re.fullmatch(r"\[([^\]]+)\]\(results/([^)]+)\)", cells[0])
        assert m and m.group(1) == m.group(2), f"first cell is not a link to its file: {cells[0]}"
        name = m.group(1)
        assert name not in index, f"{name} has two rows in the index"
        index[name] = dict(zip(("date", "gpu", "commit", "what", "status"), cells[1:]))
    return index


def test_every_results_file_has_one_index_row():
    files = {p.name for p in RESULTS_DIR.iterdir() if p.is_file()}
    index = _index()
    assert sorted(files - index.keys()) == [], "files in docs/results/ without an index row"
    assert sorted(index.keys() - files) == [], "index rows naming files that do not exist"


def test_index_rows_agree_with_file_names():
    for name, row in _index().items():
        date, gpu = re.match(r"(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-", name).groups()
        assert row["date"] == date, name
        assert row["gpu"].startswith(GPU_OF_NAME[gpu]), f"{name}: GPU {row['gpu']!r}"
        assert row["commit"] and row["what"], f"{name}: empty commit or summary"


def test_superseded_rows_point_at_current_files():
    index = _index()
    for name, row in index.items():
        status = row["status"]
        if status.startswith("current"):
            continue
        head = status.split(" (")[0]
        assert head.startswith("superseded by ["), f"{name}: status {status!r}"
        targets = re.findall(r"\]\(results/([^)]+)\)", head)
        assert targets, f"{name}: superseded by nothing"
        for target in targets:
            assert target in index, f"{name}: superseded by {target}, which is not indexed"
            assert target != name
            assert target[:10] >= name[:10], f"{name}: superseded by an earlier file {target}"
            assert index[target]["status"].startswith("current"), (
                f"{name} points at {target}, itself superseded: point at the current file"
            )


DOCS = [README, *sorted(ROOT.glob("docs/*.md")), *sorted(RESULTS_DIR.glob("*.md")),
        ROOT / "studies" / "README.md"]


def test_pending_exemptions_name_no_existing_file():
    existing = sorted(rel for rel in PENDING if (ROOT / rel).exists())
    assert existing == [], "these exist now: remove them from PENDING"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        rel = path.relative_to(ROOT).as_posix()
        if rel in PENDING and not path.exists():
            continue
        assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


# (doc, heading of its figures table): the README's headline rows, results.md's full table
FIGURE_TABLES = [(README, "## Results"), (RESULTS_MD, "## Latest figure of each kind")]


@pytest.mark.parametrize("doc, heading", FIGURE_TABLES,
                         ids=lambda x: x.relative_to(ROOT).as_posix() if isinstance(x, Path) else x)
def test_figure_tables_name_gpu_date_and_file(doc, heading):
    rows = _table(doc.read_text(), heading)
    assert rows, f"{doc.name} has no table under {heading!r}"
    for cells in rows:
        what, figure, gpu, date, source = cells
        assert figure, f"{what}: no figure"
        assert re.search(r"H100|H200|CPU|A100", gpu), f"{what}: GPU {gpu!r}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"{what}: date {date!r}"
        links = re.findall(r"\]\(([^)#]+)\)", source)
        files = [(doc.parent / link).resolve() for link in links]
        assert files and all(f.parent == RESULTS_DIR.resolve() for f in files), (
            f"{what}: source {source!r} is not links to results files")
        for f in files:
            assert f.is_file(), f"{what}: {f.name} does not exist"
            assert f.name.startswith(date), f"{what}: dated {date} but its file is {f.name}"


def test_readme_headline_rows_are_rows_of_the_full_table():
    """A headline the README gives is the same row (figure, GPU, date, file) as in results.md,
    so that the two cannot drift apart."""
    full = {cells[0]: cells for cells in _table(RESULTS_MD.read_text(), FIGURE_TABLES[1][1])}
    for cells in _table(README.read_text(), "## Results"):
        row = full.get(cells[0])
        assert row, f"README row {cells[0]!r} is not in docs/results.md's table"
        as_in_readme = [*row[:4], row[4].replace("](results/", "](docs/results/")]
        assert cells == as_in_readme, f"README row {cells[0]!r} differs from docs/results.md's"


def test_readme_keeps_the_commands_ci_runs():
    readme = README.read_text()
    assert "`ci/nox.sh -s build test`" in readme
    assert "`ci/nox.sh -s gate`" in readme
    run = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"ci/nox\.sh -s ([a-z ]+)", run)
    assert m, ".ci/run does not run ci/nox.sh"
    sessions = m.group(1).split()
    assert sessions.index("build") < sessions.index("test"), sessions
