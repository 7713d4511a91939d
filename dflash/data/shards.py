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


MANIFEST, HOLDOUT = "manifest.json", "holdout.jsonl"


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_hashes(root) -> dict[str, str]:
    """{path relative to root: sha256} of the dataset's files: the shards under train/ and holdout.jsonl (what the
    reader and evaluate check before they use them; any other file found there later is refused)."""
    root = Path(root)
    files = [f for f in sorted((root / "train").rglob("*")) if f.is_file()] + [root / HOLDOUT]
    return {f.relative_to(root).as_posix(): _sha256(f) for f in files if f.is_file()}


def seal(manifest: dict) -> str:
    """The manifest's hash of its own content (every key but manifest_hash): 16 hex."""
    body = {k: v for k, v in manifest.items() if k != "manifest_hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def sealed(root, manifest: dict) -> dict:
    """`manifest` as JSON holds it, plus `files` (file_hashes) and, last, `manifest_hash` (its own hash, so an edit is
    caught): what manifest.json holds."""
    manifest = json.loads(json.dumps({**manifest, "files": file_hashes(root)}, default=str))
    manifest["manifest_hash"] = seal(manifest)
    return manifest


def write_manifest(root, manifest: dict) -> dict:
    """Write root/manifest.json (atomically) from a plain dict, `sealed`; returns what was written. The data stage
    writes its own through `gather.write_manifest`, as the `records.manifest.Manifest` record; this writes any other
    (the tests' partial ones, a manifest of another age)."""
    from dflash.atomic import atomic_write_json
    manifest = sealed(root, manifest)
    atomic_write_json(Path(root) / MANIFEST, manifest)
    return manifest


def read_manifest(root) -> dict:
    """root/manifest.json, only as the data stage wrote it: with its file hashes and matching its own hash (cheap;
    `verify_dataset` checks the files too). Otherwise a UserError naming the file, what is wrong and the remedy."""
    from dflash.errors import UserError
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path}: dataset manifest not found (run the data stage first)")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__}: {e}); rerun the data stage") from None
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        raise UserError(f"{path}: no file hashes (`files`): made by an older data stage or edited, so the shards "
                        f"and holdout.jsonl cannot be verified and are not used; rerun the data stage")
    if m.get("manifest_hash") != seal(m):
        found = _diagnose(Path(root), m)
        raise UserError(f"{path}: edited after the data stage (it no longer matches its manifest_hash"
                        f"{': ' + '; '.join(found) if found else ''}); rerun the data stage")
    from pydantic import ValidationError

    from dflash.records.manifest import ManifestCore
    try:
        ManifestCore.model_validate(m)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{path}: key '{'.'.join(map(str, err['loc']))}': {err['msg']}; rerun the data stage") from None
    return m


def _diagnose(root: Path, m: dict) -> list[str]:
    """Which of an edited manifest's keys disagree with the data on disk (on the error path only: it reads it all)."""
    try:
        problem = _mismatch(root, m)
        if problem:
            return [problem[0].removeprefix(f"{root / MANIFEST}: ")]
        found = []
        samples = _samples_by_id(root, m)
        n = len(samples) if samples is not None else 0
        if m.get("num_samples") != n:
            found.append(f"num_samples says {m.get('num_samples')}, the shards hold {n} rows")
        holdout = read_holdout(root)
        chash = content_hash_ds(samples, holdout) if samples is not None else content_hash([], holdout)
        if m.get("content_hash") != chash:
            found.append(f"content_hash says {m.get('content_hash')}, the data hashes to {chash}")
        return found
    except Exception as e:   # noqa: BLE001 - a diagnosis only: the refusal stands whatever it finds
        return [f"the data could not be compared ({type(e).__name__})"]


def _samples_by_id(root: Path, m: dict):
    """Every training row of the dataset (all buckets), sorted by id, as one datasets.Dataset (None: no rows)."""
    from datasets import concatenate_datasets, load_from_disk
    parts = [load_from_disk(str(bucket_dir(root, int(e)))) for e, n in m.get("buckets", {}).items() if n]
    return concatenate_datasets(parts).sort("id") if parts else None


def _kind(name: str) -> str:
    return "shard" if name.startswith("train/") else "file"


REBUILD = "rerun the data stage to rebuild the dataset"   # the remedy of most differences


def _mismatch(root: Path, m: dict) -> tuple[str, str] | None:
    """The first difference between the disk and the manifest, in every direction: files (listed, present, hashes),
    bucket folders, row counts, as (the difference, what to do); None when there is none."""
    from datasets import load_from_disk
    files = m["files"]
    have = {f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file()} - {MANIFEST}
    extra = sorted(have - set(files))
    if extra:
        return (f"{root / extra[0]}: {_kind(extra[0])} not in the dataset manifest (the folder was changed after the "
                f"data stage)", "move it out of the dataset folder (a rerun of the data stage keeps it and refuses)")
    for name, digest in sorted(files.items()):
        path = root / name
        if not path.is_file():
            return (f"{path}: {_kind(name)} missing (listed in {root / MANIFEST})", REBUILD)
        got = _sha256(path)
        if got != digest:
            return (f"{path}: {_kind(name)} corrupted (sha256 {got[:16]}... differs from the manifest's "
                    f"{digest[:16]}...)", REBUILD)
    want = {int(e): int(n) for e, n in (m.get("buckets") or {}).items() if n}
    folders = {int(d.name.split("-")[1]): d for d in (root / "train").glob("bucket-*") if d.is_dir()}
    if set(folders) - set(want):
        return (f"{folders[min(set(folders) - set(want))]}: a bucket folder the manifest does not list", REBUILD)
    if set(want) - set(folders):
        edge = min(set(want) - set(folders))
        return (f"{bucket_dir(root, edge)}: missing (the manifest lists {want[edge]} rows there)", REBUILD)
    for edge, n in sorted(want.items()):
        rows = len(load_from_disk(str(folders[edge])))
        if rows != n:
            return (f"{folders[edge]} holds {rows} rows, {root / MANIFEST} says {n} (buckets)", REBUILD)
    if sum(want.values()) != m.get("num_samples"):
        return (f"{root / MANIFEST}: num_samples says {m.get('num_samples')}, the shards hold {sum(want.values())} "
                f"rows", REBUILD)
    held = len(read_holdout(root))
    if "holdout" in m and held != m["holdout"]:
        return (f"{root / HOLDOUT} holds {held} prompts, {root / MANIFEST} says {m['holdout']}", REBUILD)
    return None


def verify_dataset(root) -> dict:
    """The dataset folder exactly as the data stage wrote it, or a UserError naming the first difference: the manifest
    (its own hash, its file hashes), every file (listed, present, sha256), every bucket folder, the row counts of
    every bucket and the holdout. Reads every file once (sha256). Returns the manifest."""
    from dflash.errors import UserError
    root = Path(root)
    m = read_manifest(root)
    problem = _mismatch(root, m)
    if problem:
        raise UserError(f"{problem[0]}; {problem[1]}")
    return m


def verify_file(root, name: str) -> Path:
    """One file of the dataset folder (e.g. holdout.jsonl) checked against its hash in the manifest."""
    from dflash.errors import UserError
    root = Path(root)
    files = read_manifest(root)["files"]
    path = root / name
    if name not in files:
        raise UserError(f"{path}: not in {root / MANIFEST}, so it cannot be verified; rerun the data stage")
    if not path.is_file():
        raise UserError(f"{path}: missing (listed in {root / MANIFEST}); rerun the data stage")
    if _sha256(path) != files[name]:
        raise UserError(f"{path}: changed after the data stage (its sha256 differs from the one in {root / MANIFEST});"
                        f" rerun the data stage to rebuild it")
    return path


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

def bucket_dirs(root) -> dict[int, Path]:
    """{edge: folder} of the buckets that hold rows, from the manifest."""
    m = read_manifest(root)
    return {int(e): bucket_dir(root, int(e)) for e, n in m["buckets"].items() if n}


def load_bucket(root, edge: int):
    from datasets import load_from_disk
    return load_from_disk(str(bucket_dir(root, edge)))


def read_holdout(root) -> list[dict]:
    p = Path(root) / HOLDOUT
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
