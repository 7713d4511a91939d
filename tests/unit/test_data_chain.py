"""The data stage as a chain (issue 50 item 4): dflash/data/README.md names an owner for every step and each exists;
the steps before the cut record what they drop, per source, and every shard makes the same choices. (No function over
60 lines: tests/unit/test_house_rules.py, over the whole package.)"""
import importlib
import json
import re
from pathlib import Path

from dflash.data import select, sources
from dflash.data.sources import SourceSpec
from dflash.data.tally import READ, Tally

DATA = Path(importlib.import_module("dflash.data").__file__).parent


def test_readme_names_an_owner_for_every_step_and_each_exists():
    text = (DATA / "README.md").read_text()
    rows = re.findall(r"^\| (\w[\w ]*) \| `([\w.]+)`", text, re.M)
    assert [s for s, _ in rows] == ["read", "normalise", "dedupe", "hold out", "scatter", "regenerate", "tokenise",
                                    "filter", "weight", "gather", "shard"]
    for _, owner in rows:
        module, name = owner.rsplit(".", 1)
        assert hasattr(importlib.import_module(f"dflash.data.{module}"), name), owner


def test_read_steps_record_what_they_drop_and_every_shard_holds_out_the_same(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(8)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, rows[0], {"x": 1}]) + "{not json\n")
    spec = SourceSpec(name="a", path=str(path))

    def first_pass(shard, nshards):
        """read -> normalise -> dedupe -> hold out -> scatter, as expand._chain composes them."""
        read, hold = Tally(READ), select.HoldOut(2, seed=0)
        convs = select.dedupe(sources.normalised(sources.read(spec, None, read), spec, read), set(), read)
        mine = list(select.scatter(hold.watch(convs), shard, nshards))
        read.close_source("a", spec.path)
        return read, hold, mine

    read, hold, whole = first_pass(0, 1)
    assert read.counts["a"] == {"rows": 11, "valid": 8}
    assert read.rejects["a"] == {"duplicate": 1, "missing_conversation": 1, "invalid_json": 1}
    assert len(whole) == 8 and all(c["hash"] for c in whole)
    assert len(list(hold.exclude(whole, Tally()))) == 6
    parts = [first_pass(i, 3) for i in range(3)]
    assert all(sorted(h for _, h, _ in p[1].heap) == sorted(h for _, h, _ in hold.heap) for p in parts)   # the same
    assert sorted(c["id"] for p in parts for c in p[2]) == sorted(c["id"] for c in whole)   # each in one part

