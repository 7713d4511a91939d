"""The `code` data source in the data stage: evaluation prompts come from held-out files only, no file that gives
one feeds training (in every data shard), `files: all` adds the pre-training files, `per_file` caps each file."""
from collections import Counter

import pytest

from support.data import TINY_PRETRAIN, target_section
from dflash import config as C
from dflash.data import code_corpus, shards
from dflash.data.expand import expand, expand_part
from dflash.data.gather import finish
from dflash.data.rows import conv_hash, rank
from dflash.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = {"corpus_mb": 1, "heldout_fraction": 0.3}     # the stdlib's first MiB, about 30% of its files held out
PER_FILE, HOLDOUT = 4, 6


def code_loaded(tmp_path, target, holdout=HOLDOUT, **cc):
    """The tiny target, the `code` source alone (every conversation of the corpus, PER_FILE a file), no regeneration."""
    return C.from_dict({
        "results_dir": str(tmp_path), "drafter": {"block_size": 4},
        "target": {**target_section(target), "pretrain": {**TINY_PRETRAIN, **CORPUS}},
        "data": {"builtin_corpus": {"enabled": False}, "regenerate": {"enabled": False}, "holdout": holdout,
                 "num_proc": 1, "min_supervised_blocks": 1, "max_length": 1024, "truncation": "truncate",
                 "bucket_edges": [256, 1024],
                 "code_completion": {"enabled": True, "max_conversations": 10000, "per_file": PER_FILE, **cc}}})


def file_of(sid: str) -> str:
    """`code-<root>/<path>:<qualname>:<line>` -> `<root>/<path>`."""
    return sid.removeprefix("code-").rsplit(":", 2)[0]


def heldout(name: str) -> bool:
    return code_corpus.is_heldout(name.split("/", 1)[1], CORPUS["heldout_fraction"])


def unique(convs):
    """The source's conversations as the data stage keeps them (the first of identical ones), with their hash."""
    seen, out = set(), []
    for c in convs:
        h = conv_hash(c["messages"])
        if h not in seen:
            seen.add(h)
            out.append({**c, "hash": h})
    return out


def training_ids(out) -> list[str]:
    return [i for edge in shards.bucket_dirs(out) for i in shards.load_bucket(out, edge)["id"]]


def check_separation(loaded, out):
    """Holdout from held-out files only; no training row of a holdout file; every other conversation trained on or
    rejected for a counted reason. Returns (holdout ids, training ids, source conversations, manifest)."""
    m = shards.read_manifest(out)
    st = m["sources"]["code"]
    hold = [h["id"] for h in shards.read_holdout(out)]
    train = training_ids(out)
    convs = unique(code_corpus.completion_source(loaded.cfg.target.pretrain, loaded.cfg.data.code_completion))
    hold_files = {file_of(i) for i in hold}
    assert len(hold) == HOLDOUT and all(heldout(f) for f in hold_files)                              # (a)
    assert train and not {file_of(i) for i in train} & hold_files                                    # (b)
    siblings = [c for c in convs if c["file"] in hold_files and c["id"] not in hold]
    assert siblings and st["rejected"]["holdout_file"] == len(siblings)
    assert st["holdout"] == HOLDOUT and st["kept"] == len(train) == len(convs) - HOLDOUT - len(siblings)
    assert st["from_heldout_files"] == sum(c["heldout"] for c in convs)
    assert st["from_pretrain_files"] == sum(not c["heldout"] for c in convs)
    assert sorted(train + hold) == sorted(c["id"] for c in convs if c["id"] not in {s["id"] for s in siblings})
    return hold, train, convs, m


def test_files_all_trains_on_pretraining_files_but_never_on_an_evaluation_prompts_file(tmp_path, tiny_target):
    loaded = code_loaded(tmp_path, tiny_target, files="all")
    expand(loaded, tmp_path / "one", progress=False)
    hold, train, convs, m = check_separation(loaded, tmp_path / "one")
    assert any(not heldout(file_of(i)) for i in train)                                               # (c)
    assert any(heldout(file_of(i)) for i in train)            # held-out files that give no prompt are trained on
    assert m["sources"]["code"]["from_pretrain_files"] > m["sources"]["code"]["from_heldout_files"] > 0
    per_file = Counter(file_of(i) for i in hold + train)                                             # (d)
    assert max(per_file.values()) == PER_FILE
    more = code_corpus.completion_source(loaded.cfg.target.pretrain, loaded.cfg.data.code_completion.model_copy(
        update={"per_file": 8}))
    assert max(Counter(c["file"] for c in more).values()) > PER_FILE and len(more) > len(convs)
    # two data shards: each excludes the same files, the gather gives the dataset of one
    parts = [expand_part(loaded, i, 2, tmp_path / f"p{i}", progress=False) for i in range(2)]
    assert all(len(p["samples"]) for p in parts) and all(p["rejects"]["code"]["holdout_file"] for p in parts)
    two = finish(loaded, parts, tmp_path / "two").model_dump(exclude_unset=True)     # the Manifest record, as written
    assert two["content_hash"] == m["content_hash"] and two["sources"] == m["sources"]
    assert [h["id"] for h in shards.read_holdout(tmp_path / "two")] == hold and training_ids(tmp_path / "two") == train


def test_files_heldout_keeps_the_holdout_prompts_and_drops_their_siblings(tmp_path, tiny_target):
    loaded = code_loaded(tmp_path, tiny_target)
    expand(loaded, tmp_path / "out", progress=False)
    hold, train, convs, m = check_separation(loaded, tmp_path / "out")
    assert all(heldout(file_of(i)) for i in train) and m["sources"]["code"]["from_pretrain_files"] == 0
    # the holdout is what it was before the file-level separation: the lowest seeded ranks of the conversations
    lowest = sorted(convs, key=lambda c: int(rank(f"h{loaded.cfg.seed}", c["hash"])[:16], 16))[:HOLDOUT]
    assert sorted(hold) == sorted(c["id"] for c in lowest)


def test_holdout_larger_than_the_heldout_files_give_is_refused(tmp_path, tiny_target):
    loaded = code_loaded(tmp_path, tiny_target, holdout=40, files="all")    # < 40 of held-out files, > 40 in all
    with pytest.raises(UserError, match=r"data.holdout \(40\) exceeds the \d+ conversations that may be evaluation"):
        expand(loaded, tmp_path / "out", progress=False)
