"""docs/benchmarks.md is generated from the JSON committed under bench/results/ (bench/tables.py): the committed file is
what the JSON gives, and a table's figures and tree come from the files a row names."""
import json
import shutil
from pathlib import Path

from bench import tables

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def test_the_committed_benchmarks_page_is_what_the_json_gives():
    assert (REPO / "docs" / "benchmarks.md").read_text() == tables.render(RESULTS), \
        "docs/benchmarks.md is stale: python bench/tables.py --write docs/benchmarks.md"


def test_check_names_a_stale_page(tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text(tables.render(RESULTS).replace("12.88", "13.88"))   # a figure typed by hand
    assert tables.main(["--check", str(page)]) == 1
    assert "python bench/tables.py --write" in capsys.readouterr().err
    assert tables.main(["--write", str(page)]) == 0 and tables.main(["--check", str(page)]) == 0


def row_of(text: str, needle: str) -> list[str]:
    line = next(x for x in text.splitlines() if needle in x)
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_new_result_enters_its_table_with_its_tree(tmp_path):
    """A summary a later session copies out: its figures straight from the JSON, its tree from the bench's record
    (a commit, else the content hash); an older file's from its name, else the run's git marked as recorded."""
    res = tmp_path / "results"
    src = RESULTS / "2026-12-04-h200-r9" / "summary-1t1d-c2-96630e0.json"
    (res / "2027-01-02-h200").mkdir(parents=True)
    (res / "2027-01-01-h200").mkdir()
    s = json.loads(src.read_text())
    s.update(run_id="h200-1t1d-new", started_at="2027-01-02T10:00:00+00:00", throughput={"ktok_per_s": 13.4567})
    s["bench"] = {"tree": {"hash": "0123456789abcdef", "files": 130, "commit": None, "head": "a" * 40,
                           "differs": {"count": 2, "paths": ["dflash/x.py", "bench/y.py"]}}}
    (res / "2027-01-02-h200" / "summary-1t1d.json").write_text(json.dumps(s))
    shutil.copy(src, res / "2027-01-01-h200" / "summary-1t1d-c2-96630e0.json")
    old = json.loads(src.read_text())
    old.update(run_id="h200-1t1d-old", git={"commit": "e80c2acef41ee075c7ed7482d58b7258850587d7", "dirty": True})
    (res / "2027-01-01-h200" / "summary-1t1d-x.json").write_text(json.dumps(old))
    text = tables.render(res)
    new = row_of(text, "2027-01-02-h200/summary-1t1d.json")
    assert new[0] == "2027-01-02 10:00" and new[1] == "h200-1t1d" and "13.46" in new
    assert "content 0123456789abcdef (not a commit; HEAD aaaaaaa differs in 2 file(s))" in new
    assert "96630e0" in row_of(text, "summary-1t1d-c2-96630e0.json")
    assert "e80c2ac (recorded)" in row_of(text, "summary-1t1d-x.json")
    lines = [x for x in text.splitlines() if "summary-1t1d" in x]
    assert "2027-01-02" in lines[0]                      # newest first
