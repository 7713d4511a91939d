"""Scale of the non-generating data stage: N synthetic conversations (no regeneration) through `python -m dflash data`,
peak memory of the stage and its worker processes together (RSS, and RSS less file-backed pages: the heap; the
memory-mapped Arrow files are page cache the kernel can reclaim), sampled every 0.2 s, and conversations per second.

    python bench/data_scale.py --target results/target/tiny --sizes 50000,200000 --out /tmp/data_scale.json

Conversations: 1-3 turns, a system prompt on some, answers of 20-120 words drawn from a fixed vocabulary (seeded);
the tokenizer is the target's. The JSON holds bench/common.py's envelope (command, date, versions, tree), the datasets
version and CPU count, and per size: seconds, conversations/s, peak RSS in MB, samples, tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import Record  # noqa: E402

WORDS = ("return the value of a list string object function module class method argument keyword default file "
         "path number items sequence iterator generator error raise index key dictionary set tuple integer float "
         "byte encoding line text pattern match group format time date zone thread lock queue process").split()


def conversations(n: int, path: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "system", "content": "You are a helpful assistant."}] if i % 4 == 0 else []
            for t in range(1 + i % 3):
                q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20)))
                a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
                msgs += [{"role": "user", "content": f"[{i}.{t}] {q}?"}, {"role": "assistant", "content": a + "."}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def run(target: str, n: int, num_proc: int, work: Path) -> dict:
    import yaml
    src = work / f"convs-{n}.jsonl"
    conversations(n, src)
    cfg = {"results_dir": str(work / f"results-{n}"), "dataset_name": f"scale-{n}",
           "target": {"path": str(Path(target).resolve()), "build": "tiny"}, "drafter": {"block_size": 16},
           "data": {"builtin_corpus": {"enabled": False}, "regenerate": {"enabled": False}, "holdout": 32,
                    "num_proc": num_proc, "max_length": 1024, "bucket_edges": [256, 512, 768, 1024],
                    "min_supervised_blocks": 1, "sources": [{"name": "synthetic", "path": str(src)}]}}
    (work / f"c-{n}.yaml").write_text(yaml.safe_dump(cfg))
    # a fresh process per size; its tree (the stage and its datasets.map workers) sampled every 0.2 s: RSS, and
    # RSS less file-backed/shared pages (anonymous: the heap; memory-mapped Arrow files are page cache, reclaimable)
    import psutil
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "data", "--config", str(work / f"c-{n}.yaml"),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    peak_rss = peak_anon = 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        rss = anon = 0
        try:
            for q in [root, *root.children(recursive=True)]:
                mi = q.memory_info()
                rss += mi.rss
                anon += mi.rss - mi.shared
        except psutil.Error:
            pass
        peak_rss, peak_anon = max(peak_rss, rss), max(peak_anon, anon)
        time.sleep(0.2)
    seconds = time.time() - t0
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"data stage failed for {n}: {err[-3000:]}")
    res = {"seconds": seconds, "max_rss_mb": peak_rss / 2**20, "max_anon_mb": peak_anon / 2**20}
    m = json.loads((work / f"results-{n}" / "data" / f"scale-{n}" / "manifest.json").read_text())
    return {"conversations": n, "seconds": round(res["seconds"], 1), "conversations_per_s": round(n / res["seconds"], 1),
            "peak_rss_mb": round(res["max_rss_mb"], 1), "peak_anon_mb": round(res["max_anon_mb"], 1),
            "samples": m["num_samples"], "tokens": m["total_tokens"],
            "num_proc": num_proc, "content_hash": m["content_hash"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a target folder (its tokenizer and chat template are used)")
    p.add_argument("--sizes", default="50000,200000")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import datasets
    rep = Record(a.out, argv)
    rep.update(datasets=datasets.__version__, cpus=os.cpu_count(), results=[])
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in a.sizes.split(",")):
            r = run(a.target, n, a.num_proc, Path(tmp))
            print(json.dumps(r), flush=True)
            rep["results"].append(r)
            rep.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
