"""Length-bucketed Arrow shards, holdout.jsonl and the manifest's content hash and histograms.

Layout under a dataset folder (see docs/architecture.md):
  manifest.json, holdout.jsonl, train/bucket-<edge:05d>/ (a `datasets` folder; only buckets holding rows exist)
Columns: id (str), source (str), input_ids (list<int32>), loss_mask (list<int8>), length (int32); unpadded.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
from pathlib import Path

import numpy as np

COLUMNS = ("id", "source", "input_ids", "loss_mask", "length")


def features():
    from datasets import Features, List, Value
    return Features({"id": Value("string"), "source": Value("string"), "input_ids": List(Value("int32")),
                     "loss_mask": List(Value("int8")), "length": Value("int32")})


def bucket_for(length: int, edges) -> int | None:
    """The smallest edge >= length (None when longer than every edge)."""
    edges = sorted(edges)
    i = bisect.bisect_left(edges, length)
    return edges[i] if i < len(edges) else None


def bucket_dir(root, edge: int) -> Path:
    return Path(root) / "train" / f"bucket-{edge:05d}"


def write_buckets(samples: list[dict], root, edges, shard_rows: int) -> dict[int, int]:
    """Write samples (in the given order) into one datasets folder per bucket; return {edge: count} for all edges."""
    import datasets
    from datasets import Dataset

    by_edge: dict[int, list[dict]] = {e: [] for e in sorted(edges)}
    for s in samples:
        by_edge[bucket_for(s["length"], edges)].append(s)
    counts = {}
    progress = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        for edge, rows in by_edge.items():
            counts[edge] = len(rows)
            if not rows:
                continue
            cols = {c: [r[c] for r in rows] for c in COLUMNS}
            ds = Dataset.from_dict(cols, features=features())
            ds.save_to_disk(str(bucket_dir(root, edge)), num_shards=max(1, math.ceil(len(rows) / shard_rows)))
    finally:
        if progress:
            datasets.enable_progress_bars()
    return counts


def file_hashes(root) -> dict[str, str]:
    """{path relative to root: sha256} of every file under root/train: what the reader checks before training."""
    import hashlib
    root = Path(root)
    out = {}
    for f in sorted((root / "train").rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                out[f.relative_to(root).as_posix()] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out


def verify_bucket(root, folder, files: dict[str, str]) -> None:
    """Check every file of one bucket folder against the manifest's hashes; a UserError names the first bad shard."""
    import hashlib
    from dflash.errors import UserError
    root, folder = Path(root), Path(folder)
    rel = folder.relative_to(root).as_posix() + "/"
    want = {k: v for k, v in files.items() if k.startswith(rel)}
    have = {f.relative_to(root).as_posix() for f in folder.rglob("*") if f.is_file()}
    for extra in sorted(have - set(want)):
        raise UserError(f"{root / extra}: shard not in the dataset manifest (the dataset folder was changed after "
                        f"the data stage; rerun it)")
    for name, digest in sorted(want.items()):
        path = root / name
        if not path.is_file():
            raise UserError(f"{path}: shard missing (listed in {root / 'manifest.json'}; rerun the data stage)")
        with open(path, "rb") as fh:
            got = hashlib.file_digest(fh, "sha256").hexdigest()
        if got != digest:
            raise UserError(f"{path}: shard corrupted (sha256 {got[:16]}... differs from the manifest's "
                            f"{digest[:16]}...); rerun the data stage to rebuild it")


def write_buckets_ds(ds, root, edges, shard_rows: int, work) -> dict[int, int]:
    """`write_buckets` for a datasets.Dataset (streamed from Arrow on disk, its order kept); {edge: count}."""
    edges = sorted(edges)
    counts = {}
    lo = 0
    for i, edge in enumerate(edges):
        sub = ds.filter(lambda n, lo=lo, hi=edge: [lo < x <= hi for x in n], input_columns="length", batched=True,
                        batch_size=8192, cache_file_name=str(Path(work) / f"bucket-{edge}.arrow"))
        counts[edge] = len(sub)
        if len(sub):
            sub.save_to_disk(str(bucket_dir(root, edge)), num_shards=max(1, math.ceil(len(sub) / shard_rows)))
        lo = edge
    return counts


def content_hash_ds(ds_by_id, holdout: list[dict]) -> str:
    """`content_hash` of a datasets.Dataset already sorted by id (read in batches)."""
    h = hashlib.sha256()
    for b in ds_by_id.select_columns(["id", "source", "input_ids", "loss_mask"]).iter(batch_size=1024):
        for sid, src, ids, mask in zip(b["id"], b["source"], b["input_ids"], b["loss_mask"]):
            h.update(b"T" + sid.encode() + b"\0" + src.encode() + b"\0")
            h.update(np.asarray(ids, dtype="<i4").tobytes() + b"\0")
            h.update(np.asarray(mask, dtype="<i1").tobytes() + b"\0")
    _hash_holdout(h, holdout)
    return h.hexdigest()[:16]


def _hash_holdout(h, holdout):
    for s in sorted(holdout, key=lambda s: s["id"]):
        h.update(b"H" + s["id"].encode() + b"\0" + s["source"].encode() + b"\0")
        h.update(np.asarray(s["prompt_ids"], dtype="<i4").tobytes() + b"\0")
        h.update(np.asarray(s["reference_ids"], dtype="<i4").tobytes() + b"\0")


def content_hash(samples: list[dict], holdout: list[dict]) -> str:
    """Hash of the kept content only (ids, sources and token sequences; order-independent): 16 hex."""
    h = hashlib.sha256()
    for s in sorted(samples, key=lambda s: s["id"]):
        h.update(b"T" + s["id"].encode() + b"\0" + s["source"].encode() + b"\0")
        h.update(np.asarray(s["input_ids"], dtype="<i4").tobytes() + b"\0")
        h.update(np.asarray(s["loss_mask"], dtype="<i1").tobytes() + b"\0")
    for s in sorted(holdout, key=lambda s: s["id"]):
        h.update(b"H" + s["id"].encode() + b"\0" + s["source"].encode() + b"\0")
        h.update(np.asarray(s["prompt_ids"], dtype="<i4").tobytes() + b"\0")
        h.update(np.asarray(s["reference_ids"], dtype="<i4").tobytes() + b"\0")
    return h.hexdigest()[:16]


def length_histogram(lengths, max_length: int, bins: int = 16) -> dict[str, int]:
    """Counts per equal-width length bin over 1..max_length: {"lo-hi": n}."""
    width = max(1, math.ceil(max_length / bins))
    out = {}
    for b in range(bins):
        lo, hi = b * width + 1, min((b + 1) * width, max_length)
        if lo > max_length:
            break
        out[f"{lo}-{hi}"] = 0
    keys = list(out)
    for n in lengths:
        out[keys[min(len(keys) - 1, (max(1, n) - 1) // width)]] += 1
    return out


def write_holdout(path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "source": r["source"], "prompt_ids": list(map(int, r["prompt_ids"])),
                                "reference_ids": list(map(int, r["reference_ids"]))}) + "\n")


# ---- readers for other stages ----------------------------------------------------------------------------------

def load_manifest(root) -> dict:
    return json.loads((Path(root) / "manifest.json").read_text())


def bucket_dirs(root) -> dict[int, Path]:
    """{edge: folder} of the buckets that hold rows, from the manifest."""
    m = load_manifest(root)
    return {int(e): bucket_dir(root, int(e)) for e, n in m["buckets"].items() if n}


def load_bucket(root, edge: int):
    from datasets import load_from_disk
    return load_from_disk(str(bucket_dir(root, edge)))


def read_holdout(root) -> list[dict]:
    p = Path(root) / "holdout.jsonl"
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
