"""H200 benchmark: ceilings, micro-benchmarks and the real `train` stage, on the shapes of config/h200.yaml.

    python bench/h200.py --out bench/out [--sections NAME,...] [--steps N] [--opt SECTION.NAME=VALUE ...]
    python bench/h200.py --list                     # every section and its options

Sections are registered by name (bench/sections/*.py, each module's SECTIONS) and run in the order given; without
--sections the default ones run. Each section's options come from `--opt SECTION.NAME=VALUE`, else from the
environment variable it replaced (BENCH_E2E_RUNS, BENCH_SF_VARIANTS, ...: commands recorded in bench/results/ still
run as written), else its default; bench.json records the values used under `options`.

Shapes are read from the config (`--config`, default config/h200.yaml: bench/shapes.py): its largest bucket as the
context (3072), train.num_anchors (512) x drafter.block_size (16), target.arch (Qwen3-8B: 36 layers, hidden 4096,
32/8 heads of 128, vocab 151936), the 5-layer drafter over it, train.loss_chunk. The e2e and profile sections run
the train stage on config/h200.yaml and config/h200-long.yaml themselves.

Every section writes into one JSON (`<out>/bench.json`, saved after each section), headed by bench/common.py's
envelope: the command (with its BENCH_* variables), date, device, versions and the tree (a content hash of the
source files, and the commit only where git's HEAD holds exactly those files), so a result under bench/results/ can
be rerun and attributed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from bench import shapes  # noqa: E402
from bench.common import Job, Record, Registry, Stopwatch  # noqa: E402
from bench.sections import drafter, e2e, kernels, loss, target  # noqa: E402

ORDER = ("ceilings", "mask", "attention", "flex_tune", "loss", "drafter_variants", "specforge", "fp8", "target",
         "step_parts", "profile", "e2e")
_ALL = {s.name: s for m in (kernels, loss, drafter, target, e2e) for s in m.SECTIONS}
REGISTRY = Registry([_ALL[n] for n in ORDER])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sections", default=",".join(REGISTRY.defaults()),
                   help=f"comma-separated, run in this order: {', '.join(REGISTRY.by_name)}")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps of each e2e run")
    p.add_argument("--opt", action="append", default=[], metavar="SECTION.NAME=VALUE",
                   help="a section's option (--list names them); overrides its BENCH_* variable")
    p.add_argument("--config", default=shapes.H200, help="the config whose shapes the micro-benchmarks use")
    p.add_argument("--list", action="store_true", help="print every section and its options, then exit")
    args = p.parse_args(argv)
    args.sections = [x for x in args.sections.split(",") if x]
    try:
        REGISTRY.select(args.sections)
        args.opts = REGISTRY.parse_opts(args.opt)
    except ValueError as e:
        p.error(str(e))
    return args


def run_section(section, job: Job) -> dict:
    """The section's result, or {"error": its traceback} (the next section still runs)."""
    try:
        return section.run(job)
    except Exception:
        return {"error": traceback.format_exc()[-3000:]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(REGISTRY.describe())
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = Record(out / "bench.json", argv)
    record["options"] = {}
    sh = shapes.load(args.config)
    for section in REGISTRY.select(args.sections):
        opts = REGISTRY.options(section, args.opts)
        if opts:
            record["options"][section.name] = opts
        wall = Stopwatch()
        record[section.name] = run_section(section, Job(out, opts, args.steps, sh, record))
        record[section.name + "_section_s"] = round(wall.s, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        record.save()
        print(section.name, json.dumps(record[section.name], default=str)[:1500], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
