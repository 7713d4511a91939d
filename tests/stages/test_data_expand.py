"""Stage `data`: formats, loss mask, rejects, regeneration, manifest hash, shards."""
import json

import pytest
import torch

from support.data import good_rows, openai, sharegpt, write_jsonl, make_loaded
from dflash.data import shards
from dflash.data.expand import expand
from dflash.data.generate import regenerate
from dflash.data.sources import normalise
from dflash.data.tokenise import conversation_ids, prompt_ids
from dflash.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(tiny_target):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_target))


def masked_runs(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_both_formats_normalise_the_same():
    a = normalise(sharegpt("What is 2+2?", "Four.", system="Be brief."))
    b = normalise(openai("What is 2+2?", "Four.", system="Be brief."))
    assert a == b == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "Four."}]
    assert normalise(sharegpt("q", "a"), "openai") == "missing_conversation"


def test_loss_mask_is_exactly_the_assistant_turns(tok):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What does `json.dumps` do?"},
            {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
            {"role": "user", "content": "Show its signature."},
            {"role": "assistant", "content": "```python\njson.dumps(obj, *, indent=None)\n```"}]
    ids, mask = conversation_ids(tok, msgs)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert masked_runs(tok, ids, mask) == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert "You are terse." in unmasked and "Show its signature." in unmasked and "Serialize" not in unmasked


def test_sources_in_both_formats_and_files(tmp_path, data_cfg, tok):
    sg = write_jsonl(tmp_path / "sg.jsonl", good_rows(5, sharegpt, "s"))
    oa = tmp_path / "oa.json"
    oa.write_text(json.dumps(good_rows(4, openai, "o") + [good_rows(1, sharegpt, "s")[0]]))   # + a duplicate
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(good_rows(3, openai, "p")), tmp_path / "p.parquet")
    from datasets import Dataset
    Dataset.from_list(good_rows(3, sharegpt, "d")).save_to_disk(str(tmp_path / "disk"))
    loaded = data_cfg([{"name": "sg", "path": sg}, {"name": "oa", "path": str(oa), "format": "openai"},
                       {"name": "pq", "path": str(tmp_path / "p.parquet")}, {"name": "disk", "path": str(tmp_path / "disk")}])
    m = expand(loaded, tmp_path / "out", progress=False)
    s = m["sources"]
    assert s["sg"]["kept"] == 5 and s["pq"]["kept"] == 3 and s["disk"]["kept"] == 3
    # the ShareGPT duplicate in an OpenAI-form file: `format: openai` rejects it as having no `messages`
    assert s["oa"]["kept"] == 4 and s["oa"]["rejected"] == {"missing_conversation": 1}
    assert m["num_samples"] == 15
    rows = [r for e in shards.bucket_dirs(tmp_path / "out") for r in shards.load_bucket(tmp_path / "out", e)]
    for r in rows:
        runs = masked_runs(tok, r["input_ids"], r["loss_mask"])
        assert len(runs) == 1 and runs[0].endswith("<|im_end|>") and "(variant" in runs[0]


def test_duplicates_across_sources_are_counted(tmp_path, data_cfg):
    a = write_jsonl(tmp_path / "a.jsonl", good_rows(4))
    b = write_jsonl(tmp_path / "b.jsonl", good_rows(2) + good_rows(3, tag="b"))
    m = expand(data_cfg([{"name": "a", "path": a}, {"name": "b", "path": b}]), tmp_path / "out", progress=False)
    assert m["sources"]["b"]["rejected"] == {"duplicate": 2} and m["sources"]["b"]["kept"] == 3


def test_malformed_rows_are_rejects_with_reasons(tmp_path, data_cfg):
    bad = [
        {"id": 1},                                                                   # no conversation
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},     # turn missing a key
        {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},   # empty turn
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},     # wrong type
        {"messages": "not a list"},                                                  # wrong type
        [1, 2, 3],                                                                   # row is not an object
        {"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]},  # unknown role
        {"messages": [{"role": "user", "content": "q"}]},                            # no assistant turn
        {"messages": []},                                                            # empty conversation
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',                 # invalid UTF-8
    ]
    rows = good_rows(3) + bad + [b'{"messages": [{"role": "user", "content": "trunc']        # truncated last line
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    m = expand(data_cfg([{"name": "messy", "path": src}]), tmp_path / "out", progress=False)
    s = m["sources"]["messy"]
    assert s["rows"] == 14 and s["kept"] == 3
    assert s["rejected"] == {"missing_conversation": 1, "missing_key": 1, "empty_turn": 1, "wrong_type": 3,
                             "unknown_role": 1, "no_assistant_turn": 1, "empty_conversation": 1,
                             "invalid_utf8": 1, "invalid_json": 1}
    assert sum(s["rejected"].values()) + s["kept"] == s["rows"]


def test_empty_or_fully_rejected_source_fails_naming_it(tmp_path, data_cfg):
    ok = write_jsonl(tmp_path / "ok.jsonl", good_rows(3))
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match=r"source 'nothing'.*empty\.jsonl has no rows"):
        expand(data_cfg([{"name": "ok", "path": ok}, {"name": "nothing", "path": empty}]), tmp_path / "o1", progress=False)
    junk = write_jsonl(tmp_path / "junk.jsonl", [{"a": 1}, b"{oops\n"])
    with pytest.raises(UserError, match=r"source 'junk'.*all 2 rows rejected.*invalid_json: 1"):
        expand(data_cfg([{"name": "ok", "path": ok}, {"name": "junk", "path": junk}]), tmp_path / "o2", progress=False)
    # rows that parse but are all too short to supervise one block are a fully rejected source too
    short = write_jsonl(tmp_path / "short.jsonl", [openai("q", "a"), openai("r", "b")])
    with pytest.raises(UserError, match=r"source 'short'.*too_few_supervised: 2"):
        expand(data_cfg([{"name": "short", "path": short}], min_supervised_blocks=3), tmp_path / "o3", progress=False)
    with pytest.raises(UserError, match=r"source 'gone'.*does not exist"):
        expand(data_cfg([{"name": "gone", "path": str(tmp_path / "gone.jsonl")}]), tmp_path / "o4", progress=False)


def test_regenerated_responses_equal_direct_greedy_generate(tiny_target, tok):
    from transformers import AutoModelForCausalLM

    from dflash.data import corpus
    from dflash.target import stop_token_ids
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target)).eval()
    convs = corpus.conversations(7)
    prompts = [prompt_ids(tok, c["messages"][:[m["role"] for m in c["messages"]].index("assistant")]) for c in convs]
    assert len({len(p) for p in prompts}) > 1                    # left padding is exercised
    resp, st = regenerate(model, tok, prompts, max_new_tokens=24, batch_size=4, progress=False)
    assert st["tokens"] > 0 and st["tokens_per_s"] > 0
    stop = set(stop_token_ids(tok, model))
    for p, r in zip(prompts, resp):
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        cut = next((k for k, t in enumerate(out) if t in stop), len(out))
        assert r == out[:cut]


def test_regeneration_in_the_stage(tmp_path, data_cfg, tok):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(6))
    # sampling at temperature 1 (the barely trained test target often ends a greedy turn at once)
    m = expand(data_cfg([{"name": "a", "path": src}], min_supervised_blocks=0.25,
                        regenerate={"enabled": True, "max_new_tokens": 12, "batch_size": 4, "device": "cpu",
                                    "temperature": 1.0}),
               tmp_path / "out", progress=False)
    r = m["regeneration"]
    assert r["enabled"] and r["tokens"] > 0 and r["tokens_per_s"] > 0
    rows = [x for e in shards.bucket_dirs(tmp_path / "out") for x in shards.load_bucket(tmp_path / "out", e)]
    assert rows and all("(variant" not in tok.decode(x["input_ids"]) for x in rows)   # responses replaced


def test_manifest_hash_changes_iff_content_changes(tmp_path, data_cfg):
    src = tmp_path / "a.jsonl"
    write_jsonl(src, good_rows(6))
    srcs = [{"name": "a", "path": str(src)}]
    h1 = expand(data_cfg(srcs, holdout=1), tmp_path / "o1", progress=False)["content_hash"]
    h2 = expand(data_cfg(srcs, holdout=1), tmp_path / "o2", progress=False)["content_hash"]
    h3 = expand(data_cfg(srcs, holdout=1, bucket_edges=[256], shard_rows=2), tmp_path / "o3", progress=False)["content_hash"]
    assert h1 == h2 == h3                       # other folder, other time, other layout: same content
    write_jsonl(src, good_rows(5) + [openai("What does function number 5 do?", "Something else entirely, really.")])
    h4 = expand(data_cfg(srcs, holdout=1), tmp_path / "o4", progress=False)["content_hash"]
    assert h4 != h1
    h5 = expand(data_cfg(srcs, holdout=1, max_length=40, truncation="truncate", bucket_edges=[40]),
                tmp_path / "o5", progress=False)["content_hash"]
    assert h5 != h4                             # truncated token sequences are other content


def test_shards_round_trip_and_manifest(tmp_path, data_cfg, tok):
    from datasets import load_from_disk
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(12) + [openai("long " * 40, "answer " * 60)])
    m = expand(data_cfg([{"name": "a", "path": src, "weight": 2.0}], holdout=2, bucket_edges=[32, 64, 128, 256],
                        shard_rows=5), tmp_path / "out", progress=False)
    for key in ("content_hash", "num_samples", "total_tokens", "supervised_tokens", "bucket_edges", "buckets",
                "length_histogram", "sources", "regeneration", "max_length", "truncation", "created_at"):
        assert key in m
    assert m["truncation"] == "truncate" and m["max_length"] == 256
    assert m["sources"]["a"]["kept"] == 11 and m["sources"]["a"]["samples"] == 22 and m["holdout"] == 2
    hold = shards.read_holdout(tmp_path / "out")
    assert m["sources"]["a"]["truncated"] == (0 if "a-12" in [h["id"] for h in hold] else 1)
    total = 0
    edges = [0] + m["bucket_edges"]
    for e, n in m["buckets"].items():
        d = tmp_path / "out" / "train" / f"bucket-{int(e):05d}"
        assert d.exists() == (n > 0)
        if not n:
            continue
        ds = load_from_disk(str(d))
        assert len(ds) == n
        assert str(ds.features["input_ids"].feature) == "Value('int32')" or "int32" in str(ds.features["input_ids"])
        prev = edges[edges.index(int(e)) - 1]
        for r in ds:
            assert prev < r["length"] <= int(e) and len(r["input_ids"]) == len(r["loss_mask"]) == r["length"]
            total += r["length"]
    assert total == m["total_tokens"] and sum(m["length_histogram"].values()) == m["num_samples"]
    assert len(hold) == 2
    for h in hold:
        assert tok.decode(h["prompt_ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n") and h["reference_ids"]
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk["content_hash"] == m["content_hash"]


def test_truncation_drop_is_stated_and_counted(tmp_path, data_cfg):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(3) + [openai("long " * 40, "answer " * 60)])
    m = expand(data_cfg([{"name": "a", "path": src}], truncation="drop"), tmp_path / "out", progress=False)
    assert m["truncation"] == "drop" and m["sources"]["a"]["rejected"] == {"too_long": 1}


def test_synthetic_samples(tmp_path, data_cfg, tok):
    m = expand(data_cfg(synthetic={"enabled": True, "num_samples": 10, "lengths": [40, 100], "supervised_fraction": 0.5},
                        holdout=2), tmp_path / "out", progress=False)
    assert m["num_samples"] == 8 and m["holdout"] == 2 and m["buckets"] == {"64": 4, "128": 4, "256": 0}
    special = set(tok.all_special_ids)
    for e in shards.bucket_dirs(tmp_path / "out"):
        for r in shards.load_bucket(tmp_path / "out", e):
            n = r["length"]
            assert r["loss_mask"] == [0] * (n - n // 2) + [1] * (n // 2)
            assert not special & set(r["input_ids"])


def test_data_stage_cli_writes_atomically(tmp_path, tiny_target):
    import yaml

    from dflash.cli import main
    from support.data import target_section
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(4))
    raw = {"results_dir": str(tmp_path), "target": target_section(tiny_target), "drafter": {"block_size": 4},
           "data": {"builtin_corpus": {"enabled": False}, "regenerate": {"enabled": False}, "holdout": 0,
                    "min_supervised_blocks": 1, "sources": [{"name": "a", "path": src}]}}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main(["data", "--config", str(p), "--no-progress"]) == 0
    m = json.loads((tmp_path / "data" / "default" / "manifest.json").read_text())
    assert m["num_samples"] == 4
    raw["data"]["sources"] = [{"name": "b", "path": str(tmp_path / "missing.jsonl")}]
    p.write_text(yaml.safe_dump(raw))
    assert main(["data", "--config", str(p), "--no-progress"]) == 1
    # the failed run left the previous output intact and no temporary folders
    assert json.loads((tmp_path / "data" / "default" / "manifest.json").read_text()) == m
    assert [x.name for x in (tmp_path / "data").iterdir()] == ["default"]
