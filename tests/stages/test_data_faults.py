"""Bad input and rotten files in the data stage (issue 14): compressed sources, shards verified by the reader,
decode errors naming shard and row, the too_few_supervised filter explained."""
import bz2
import gzip
import json
import logging
import os

import pytest

from support.data import good_rows, openai, write_jsonl
from dflash.data.expand import expand
from dflash.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def compress(path, suffix):
    raw = path.read_bytes()
    if suffix == ".gz":
        data = gzip.compress(raw)
    elif suffix == ".bz2":
        data = bz2.compress(raw)
    else:
        import zstandard
        data = zstandard.ZstdCompressor().compress(raw)
    out = path.with_name(path.name + suffix)
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("suffix", [".gz", ".zst", ".bz2"])
def test_compressed_sources_read_as_such(tmp_path, data_cfg, suffix):
    plain = tmp_path / "a.jsonl"
    write_jsonl(plain, good_rows(6))
    js = tmp_path / "b.json"
    js.write_text(json.dumps(good_rows(3, tag="j")))
    srcs = [{"name": "a", "path": str(compress(plain, suffix))}, {"name": "b", "path": str(compress(js, suffix))}]
    m = expand(data_cfg(srcs), tmp_path / "z", progress=False)
    assert m["sources"]["a"]["kept"] == 6 and m["sources"]["a"]["rejected"] == {}
    assert m["sources"]["b"]["kept"] == 3
    ref = expand(data_cfg([{"name": "a", "path": str(plain)}, {"name": "b", "path": str(js)}]), tmp_path / "p",
                 progress=False)
    assert m["content_hash"] == ref["content_hash"]


def test_corrupt_compressed_source_names_the_file(tmp_path, data_cfg):
    p = compress(write_jsonl_path(tmp_path / "a.jsonl", 40), ".gz")
    blob = bytearray(p.read_bytes())
    blob[len(blob) // 2:len(blob) // 2 + 64] = b"\0" * 64
    p.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=r"source 'a': cannot read .*a\.jsonl\.gz"):
        expand(data_cfg([{"name": "a", "path": str(p)}]), tmp_path / "o", progress=False)


def write_jsonl_path(path, n):
    write_jsonl(path, good_rows(n))
    return path


@pytest.fixture
def dataset(tmp_path, data_cfg):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(24))
    out = tmp_path / "ds"
    m = expand(data_cfg([{"name": "a", "path": src}], bucket_edges=[256], shard_rows=8), out, progress=False)
    arrows = sorted((out / "train").rglob("*.arrow"))
    assert len(arrows) == 3 and all(k in m["files"] for k in (a.relative_to(out).as_posix() for a in arrows))
    return out, arrows


def test_reader_verifies_shards_once_and_trains_on_intact_data(dataset):
    from dflash.train.reader import ShardReader
    out, _ = dataset
    r = ShardReader(out, batch_size=4)
    assert r.batch(0).input_ids.shape == (4, 256)


@pytest.mark.parametrize("fault", ["zeroed", "random"])
def test_corrupted_shard_stops_the_run_naming_it(dataset, fault):
    from dflash.train.reader import ShardReader
    out, arrows = dataset
    bad = arrows[1]
    blob = bytearray(bad.read_bytes())
    n = min(len(blob) // 2, 32 * 1024 if fault == "zeroed" else 4 * 1024)
    start = len(blob) // 4
    blob[start:start + n] = b"\0" * n if fault == "zeroed" else os.urandom(n)
    bad.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=rf"{bad.name}: shard corrupted \(sha256 .* differs from the manifest"):
        ShardReader(out, batch_size=4)


def test_missing_or_extra_shard_named(dataset):
    from dflash.train.reader import ShardReader
    out, arrows = dataset
    arrows[0].rename(arrows[0].with_name("moved.bin"))
    with pytest.raises(UserError, match=r"moved\.bin: shard not in the dataset manifest"):
        ShardReader(out, batch_size=4)
    (arrows[0].with_name("moved.bin")).unlink()
    with pytest.raises(UserError, match=rf"{arrows[0].name}: shard missing"):
        ShardReader(out, batch_size=4)


def test_row_decode_error_names_shard_and_row(dataset):
    """A row that decodes wrong (here: 300 tokens in the 256 bucket, written so by a faulty data stage: the manifest
    matches the files) fails the run naming its shard file and row."""
    import pyarrow as pa

    from dflash.data.shards import write_manifest
    from dflash.train.reader import ShardReader
    out, arrows = dataset
    with pa.memory_map(str(arrows[2])) as src:
        table = pa.ipc.open_stream(src).read_all()
    rows = table.to_pylist()
    rows[3]["input_ids"] = rows[3]["input_ids"] + [5] * (300 - len(rows[3]["input_ids"]))
    bad = pa.Table.from_pylist(rows, schema=table.schema)
    with pa.OSFile(str(arrows[2]), "wb") as sink, pa.ipc.new_stream(sink, bad.schema) as w:
        w.write_table(bad)
    write_manifest(out, json.loads((out / "manifest.json").read_text()))
    r = ShardReader(out, batch_size=4)
    with pytest.raises(UserError, match=r"data-00002-of-00003\.arrow row 3: cannot decode the row: ValueError: 300 "
                                        r"tokens and \d+ mask values in the bucket of length 256"):
        for i in range(r.batches_per_epoch):
            r.batch(i)


def zero_32k(path):
    blob = bytearray(path.read_bytes())
    start, n = len(blob) // 4, min(len(blob) // 2, 32 * 1024)
    blob[start:start + n] = b"\0" * n
    path.write_bytes(bytes(blob))


def test_manifest_without_file_hashes_is_refused_not_warned(dataset):
    """Rule 3: a manifest without its `files` hashes (and a shard with 32 KB zeroed) was a warning, then training on
    the corrupt rows; now the reader refuses it, naming the manifest and the remedy."""
    from dflash.train.reader import ShardReader
    out, arrows = dataset
    m = json.loads((out / "manifest.json").read_text())
    del m["files"]
    (out / "manifest.json").write_text(json.dumps(m))
    zero_32k(arrows[1])
    with pytest.raises(UserError, match=r"manifest\.json: no file hashes \(`files`\).*rerun the data stage"):
        ShardReader(out, batch_size=4)


@pytest.mark.parametrize("key", ["num_samples", "content_hash"])
def test_edited_manifest_is_caught_and_the_key_named(dataset, key):
    """The manifest carries a hash of its own content: an edited num_samples or content_hash (which decides whether
    a run resumes, and what the report blames) is refused, naming the key and what the data really holds."""
    from dflash.train.reader import ShardReader
    from dflash.train.run_folder import identity
    from types import SimpleNamespace
    out, _ = dataset
    m = json.loads((out / "manifest.json").read_text())
    real = m[key]
    m[key] = 25 if key == "num_samples" else "0123456789abcdef"
    (out / "manifest.json").write_text(json.dumps(m, indent=2))
    said = rf"num_samples says 25, the shards hold {real} rows" if key == "num_samples" else \
        rf"content_hash says 0123456789abcdef, the data hashes to {real}"
    with pytest.raises(UserError, match=rf"manifest\.json: edited after the data stage .*{said}.*rerun the data stage"):
        ShardReader(out, batch_size=4)
    setup = SimpleNamespace(data_dir=out, loaded=SimpleNamespace(result_hash="r"))
    with pytest.raises(UserError, match="edited after the data stage"):   # nor does it decide a resumption
        identity(setup)


def test_disk_must_match_the_manifest_in_every_direction(tmp_path, data_cfg):
    """Beyond the table: a bucket folder gone, a stray file, the holdout edited: each named before anything uses it."""
    from dflash.data.shards import verify_dataset, verify_file
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(24))
    out = tmp_path / "ds"
    m = expand(data_cfg([{"name": "a", "path": src}], bucket_edges=[75, 256], holdout=3), out, progress=False)
    assert sum(1 for n in m["buckets"].values() if n) == 2 and m["holdout"] == 3
    assert verify_dataset(out)["content_hash"] == m["content_hash"]
    small = out / "train" / "bucket-00075"
    small.rename(tmp_path / "moved")
    with pytest.raises(UserError, match=r"bucket-00075/.*: shard missing \(listed in .*manifest\.json\)"):
        verify_dataset(out)
    (tmp_path / "moved").rename(small)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"notes\.txt: file not in the dataset manifest"):
        verify_dataset(out)
    (out / "notes.txt").unlink()
    hold = out / "holdout.jsonl"
    hold.write_text("".join(hold.read_text().splitlines(keepends=True)[:2]))   # cut to 2 prompts
    for check in (lambda: verify_file(out, "holdout.jsonl"), lambda: verify_dataset(out)):
        with pytest.raises(UserError, match=r"holdout\.jsonl: (changed after the data stage|file corrupted)"):
            check()


def test_too_few_supervised_is_explained(tmp_path, data_cfg, caplog):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(4) + [openai("q", "ab"), openai("r", "cd")])
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        m = expand(data_cfg([{"name": "a", "path": src}], min_supervised_blocks=2), tmp_path / "o", progress=False)
    f = m["filters"]["too_few_supervised"]
    assert f == {"rejected": 2, "min_supervised_tokens": 8,
                 "keys": {"data.min_supervised_blocks": 2, "drafter.block_size": 4}}
    assert m["sources"]["a"]["rejected"] == {"too_few_supervised": 2}
    assert ("2 of 6 rows rejected as too_few_supervised: fewer than 8 supervised (assistant) tokens = "
            "data.min_supervised_blocks 2 x drafter.block_size 4") in caplog.text


def test_every_regenerated_answer_empty_is_one_line_naming_the_reason(tmp_path, data_cfg):
    """The briefly trained tiny target answers with blank lines: every row is rejected as empty_response, and the
    stage says so (it raised `Column name ['reject', 'truncated'] not in the dataset`), with the remedy."""
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(8))
    loaded = data_cfg([{"name": "a", "path": src}], holdout=2,
                      regenerate={"enabled": True, "max_new_tokens": 4, "device": "cpu", "chunk_size": 8})
    with pytest.raises(UserError, match=r"source 'a' \(.*a\.jsonl\): 8 rows, 2 held out, all others rejected "
                                        r"\(empty_response: 6: the target regenerated empty answers"):
        expand(loaded, tmp_path / "o", progress=False)
