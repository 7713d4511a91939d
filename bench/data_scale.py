"""Scale of the non-generating data stage: N synthetic conversations (no regeneration) through `python -m dflash data`,
peak memory (max RSS of the stage and its worker processes) and conversations per second.

    python bench/data_scale.py --target results/target/tiny --sizes 50000,200000 --out /tmp/data_scale.json

Conversations: 1-3 turns, a system prompt on some, answers of 20-120 words drawn from a fixed vocabulary (seeded);
the tokenizer is the target's. The JSON holds the command, date, versions, and per size: seconds, conversations/s,
peak RSS in MB, samples, tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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
    # a fresh process per size, measured alone: RUSAGE_CHILDREN's max RSS is the largest of the finished children
    code = ("import resource, subprocess, sys, json, time; t=time.time(); "
            "r=subprocess.run(sys.argv[1:]); "
            "print(json.dumps({'rc': r.returncode, 'seconds': time.time()-t, "
            "'max_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024}))")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "dflash", "data", "--config",
                          str(work / f"c-{n}.yaml"), "--no-progress"], capture_output=True, text=True, env=env)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if res["rc"]:
        raise SystemExit(f"data stage failed for {n}: {out.stderr[-3000:]}")
    m = json.loads((work / f"results-{n}" / "data" / f"scale-{n}" / "manifest.json").read_text())
    return {"conversations": n, "seconds": round(res["seconds"], 1), "conversations_per_s": round(n / res["seconds"], 1),
            "peak_rss_mb": round(res["max_rss_mb"], 1), "samples": m["num_samples"], "tokens": m["total_tokens"],
            "num_proc": num_proc, "content_hash": m["content_hash"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a target folder (its tokenizer and chat template are used)")
    p.add_argument("--sizes", default="50000,200000")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import datasets
    import transformers
    rep = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.now(timezone.utc).isoformat(),
           "transformers": transformers.__version__, "datasets": datasets.__version__, "cpus": os.cpu_count(),
           "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in a.sizes.split(",")):
            r = run(a.target, n, a.num_proc, Path(tmp))
            print(json.dumps(r), flush=True)
            rep["results"].append(r)
            Path(a.out).write_text(json.dumps(rep, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
