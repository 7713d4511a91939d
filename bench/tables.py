"""The benchmark tables, generated from the JSON committed under bench/results/: every figure comes from a file
named in its row, none is typed by hand.

    python bench/tables.py --write docs/benchmarks.md     # regenerate after adding results
    python bench/tables.py --check docs/benchmarks.md     # exit 1 when the file is not what the JSON gives

tests/unit/test_bench_tables.py holds the committed docs/benchmarks.md to the committed JSON. Rows are newest first (the
results folders are dated). The tree of a row is the bench's own record (`tree`, bench/common.py), else the short
hash that ends the file's name (the session named the tree it ran so), else the run's `git.commit` as recorded
(marked: the lent machine's `.git` was stale). No git call: the output depends on the files alone.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import tree_label  # noqa: E402
from dflash.paths import RunFolder  # noqa: E402

SHORT = re.compile(r"-([0-9a-f]{7,40})$")
NUMBER = re.compile(r"-?\d+(\.\d+)?")


@dataclass
class Table:
    title: str
    intro: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)

    def render(self) -> str:
        if not self.rows:
            return ""
        cells = [[cell(v) for v in row] for row in self.rows]
        right = [all(NUMBER.fullmatch(r[i]) for r in cells if r[i]) and any(r[i] for r in cells)
                 for i in range(len(self.columns))]      # a column of numbers is right-aligned
        head = "| " + " | ".join(self.columns) + " |\n|" + "|".join("---:" if r else "---" for r in right) + "|\n"
        body = "".join("| " + " | ".join(r) + " |\n" for r in cells)
        return f"## {self.title}\n\n{self.intro}\n\n{head}{body}\n"


def cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v).replace("|", "\\|").replace("\n", " ")


def f(x, nd: int = 2):
    """x rounded to nd decimals as text ('' for a missing figure)."""
    return "" if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:.{nd}f}"


# ---- reading ---------------------------------------------------------------------------------------------------
def files(results: Path, pattern: str) -> list[Path]:
    """Files matching pattern in the dated results folders, newest folder first (then by name)."""
    return sorted(results.glob(pattern), key=lambda p: (p.parent.name, p.name), reverse=True)


def load(path: Path):
    return json.loads(path.read_text())


def where(path: Path, results: Path) -> str:
    return f"`{path.relative_to(results).as_posix()}`"


def beside(path: Path) -> dict:
    """The quality bench's record beside an archive (quality.json: its `git`), or {}."""
    q = path.parent / "quality.json"
    return load(q) if path.name.endswith(".tar.gz") and q.exists() else {}


def tree_of(path: Path, doc: dict | None = None) -> str:
    """The bench's record, else the file name's short hash, else the run's git as recorded (marked)."""
    doc = doc or {}
    tree = doc.get("tree") or (doc.get("bench") or {}).get("tree")
    if tree:
        return tree_label(tree)
    m = SHORT.search(path.name.split(".")[0])
    if m:
        return m.group(1)[:7]
    commit = (doc.get("git") or {}).get("commit") if isinstance(doc.get("git"), dict) else doc.get("git")
    return f"{str(commit)[:7]} (recorded)" if commit else ""


# ---- the tables ------------------------------------------------------------------------------------------------
def describe_run(cfg: dict) -> tuple[str, str, str, str]:
    """(shape, layout, precision, target) of a run's resolved config."""
    t, d = cfg.get("train") or {}, cfg.get("data") or {}
    edges = d.get("bucket_edges") or []
    shape = f"{max(edges)}/{t.get('num_anchors')}" if edges else ""
    gpus = len({str(x) for x in (t.get("targets") or []) + (t.get("drafters") or [])})
    layout = f"{t.get('runtime')}, {len(t.get('targets') or [])} target : {len(t.get('drafters') or [])} drafter, " \
             f"{gpus} device{'s' if gpus > 1 else ''}"
    precision = t.get("precision") or "bf16"
    precision += " + FP8 head" if t.get("fp8_lm_head") else ""
    precision += " + FP8 target" if t.get("fp8_target") else ""
    return shape, layout, precision, "compiled" if t.get("compile_target") else "eager"


def run_figures(s: dict) -> list:
    """Measured steps, Ktok/s, MFU, GPU util %, peak GB, recompiles, replicas of a run summary."""
    tp, comp, devs = s.get("throughput") or {}, s.get("compile") or {}, s.get("devices") or []
    util = [d["util_mean"] for d in devs if isinstance(d.get("util_mean"), (int, float))]
    peak = [d["peak_memory_gb"] for d in devs if isinstance(d.get("peak_memory_gb"), (int, float))]
    n = len(s.get("replica_checksums") or [])
    replicas = f"{n}, {'identical' if s.get('replicas_identical') else 'differ'}" if n else ""
    return [s.get("measured_steps"), f(tp.get("ktok_per_s")), f(tp.get("mfu"), 3),
            f(sum(util) / len(util), 1) if util else "", f(max(peak), 1) if peak else "",
            comp.get("recompiles_after_warmup"), replicas]


def e2e_table(results: Path) -> Table:
    t = Table("End to end: the `train` stage on one machine",
              "Every run summary the H200 bench copied out (`--sections e2e`, `summary-*.json`): `config/h200.yaml` "
              "(random Qwen3-8B-shaped target, 5-layer drafter; shape = largest bucket / anchors) or "
              "`config/h200-long.yaml`, with each run's `--set` keys. Ktok/s: unpadded tokens trained per second "
              "after the warm-up; MFU against the bf16 matmul ceiling (FP8 can pass 1); GPU util: the mean over the "
              "run's devices; peak GB: the largest device's; to first step: seconds from the process's start to the "
              "first training step (the warm-up included).",
              ["date", "run", "shape", "layout", "precision", "target", "measured steps", "Ktok/s", "MFU", "util %",
               "peak GB", "recompiles", "replicas", "to first step s", "tree", "file"])
    rows = [(s.get("started_at") or "", p, s) for p in results.glob("*/summary*.json") for s in [load(p)]]
    for started, p, s in sorted(rows, key=lambda r: r[0], reverse=True):
        t.rows.append([started[:16].replace("T", " "), s.get("run_name"), *describe_run(s.get("config") or {}),
                       *run_figures(s), f(s.get("seconds_to_first_step"), 1), tree_of(p, s), where(p, results)])
    return t


def restart_table(results: Path) -> Table:
    t = Table("Warm restart", "A train run restarted with the compile cache warm (`e2e` run `restart`): seconds from "
              "the process's start to the first training step.",
              ["run started", "to first step s", "warm-up s", "cache hits", "graphs", "tree", "file"])
    for p in files(results, "*/e2e*.json"):
        doc = load(p)
        w = (doc.get("e2e") or {}).get("warm_restart")
        if isinstance(w, dict) and "seconds_to_first_step" in w:
            t.rows.append([doc.get("date", "")[:16].replace("T", " "), f(w["seconds_to_first_step"], 1),
                           f(w.get("warmup_s"), 1), w.get("cache_hits"), w.get("graphs"), tree_of(p, doc),
                           where(p, results)])
    return t


def multi_gpu_tables(results: Path) -> list[Table]:
    runs = Table("Several GPUs (`bench/multi_gpu.py`)",
                 "Each part's run through `snakemake` on the GPUs of one host: the seed's split (targets : drafters) "
                 "or co-located (a target and a drafter replica on every GPU), in the threads or distributed runtime. "
                 "vs one GPU: Ktok/s per GPU over the one-GPU figure the bench read (its bar: 0.9).",
                 ["part", "run", "status", "runtime", "GPUs", "Ktok/s", "per GPU Ktok/s", "vs one GPU x", "replicas",
                  "recompiles", "util % per GPU", "tree", "file"])
    kill = Table("Several GPUs: a rank killed", "`kill -9` of the last drafter rank once the first checkpoint is "
                 "written, then the same snakemake command again (part `kill`).",
                 ["run", "status", "ranks gone s", "job exit s", "names the rank", "resume exit", "resumed from",
                  "tree", "file"])
    for p in files(results, "*/multi*gpu*.json"):
        doc = load(p)
        base = doc.get("one_gpu_ktok_per_s")
        for name, r in (doc.get("parts") or {}).items():
            status = r.get("status") or (f"error: {r['error'][:100]}" if r.get("error") else
                                         "timed out" if r.get("timed_out") else "")
            if name == "kill":
                kill.rows.append([r.get("run"), status, f(r.get("seconds_until_ranks_gone")),
                                  f(r.get("seconds_until_job_exit")), r.get("names_the_rank"), r.get("resume_exit"),
                                  r.get("resumed_from_step"), tree_of(p, doc), where(p, results)])
                continue
            per = r.get("ktok_per_s_per_gpu")
            util = ", ".join(f(d.get("util_mean"), 1) for d in r.get("devices") or [])
            t_ok = f"{r['replicas']}, {'identical' if r.get('replicas_identical') else 'differ'}" \
                if r.get("replicas") else ""
            runs.rows.append([name, r.get("run"), status, r.get("runtime"), r.get("gpus"), f(r.get("ktok_per_s")),
                              f(per), f(per / base, 3) if per and base else "", t_ok, r.get("recompiles_after_warmup"),
                              util, tree_of(p, doc), where(p, results)])
    return [runs, kill]


def specforge_table(results: Path) -> Table:
    t = Table("Drafter step against SpecForge (`--sections specforge`)",
              "Forward, backward, clip and AdamW of the drafter at context / anchors, in one process: ours "
              "(`our_step`, per precision variant) and SpecForge's `OnlineDFlashModel`. vs SpecForge: its ms / "
              "this row's ms.",
              ["shape", "step", "step ms", "peak GB", "first loss", "vs SpecForge x", "SpecForge", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        sf = doc.get("specforge") if isinstance(doc, dict) else None
        if not isinstance(sf, dict):
            continue
        for shape, row in sf.items():
            if not isinstance(row, dict):
                continue
            theirs = (row.get("specforge") or {}).get("step_ms")
            for name, m in row.items():
                if isinstance(m, dict) and ("step_ms" in m or "error" in m):
                    t.rows.append([shape, name, f(m.get("step_ms")), f(m.get("peak_gb")), f(m.get("first_loss"), 4),
                                   f(theirs / m["step_ms"], 2) if theirs and m.get("step_ms") else "",
                                   sf.get("specforge_version"), tree_of(p, doc), where(p, results)])
    return t


def variants_table(results: Path) -> Table:
    t = Table("Drafter step variants (`--sections drafter_variants`)",
              "The production drafter step (build_drafter, micro_step, AdamW) per variant, each in its own process, "
              "at the config's shape unless the variant names one (@CONTEXTxANCHORS).",
              ["variant", "step ms", "peak GB", "first step s", "drafter-only Ktok/s", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        dv = doc.get("drafter_variants") if isinstance(doc, dict) else None
        if not isinstance(dv, dict):
            continue
        for key in [k for k in dv if k.endswith("_step_ms")]:
            v = key[:-len("_step_ms")]
            t.rows.append([v, f(dv[key]), f(dv.get(f"{v}_peak_gb")), f(dv.get(f"{v}_first_step_s"), 1),
                           f(dv.get(f"{v}_drafter_only_ktok_s")), tree_of(p, doc), where(p, results)])
    return t


def loss_table(results: Path) -> Table:
    t = Table("LM-head loss (`--sections loss`)",
              "Training's fused chunked loss (`fused`) beside torch's and Liger's, forward + backward over the "
              "config's anchors x block positions and vocabulary; agrees: loss within 2e-3 relative and gradient "
              "within 2% of training's.",
              ["variant", "agrees", "fwd+bwd ms", "peak GB", "positions", "vocab", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        lo = doc.get("loss") if isinstance(doc, dict) else None
        if not isinstance(lo, dict) or "fused" not in lo:
            continue
        shape = lo.get("shape") or {}
        for name, m in lo.items():
            if isinstance(m, dict) and ("fwd_bwd_ms" in m or "error" in m):
                t.rows.append([name, m.get("agrees"), f(m.get("fwd_bwd_ms")), f(m.get("peak_gb")),
                               shape.get("positions"), shape.get("vocab"), tree_of(p, doc), where(p, results)])
    return t


def micro_table(results: Path) -> Table:
    t = Table("Ceilings, mask, attention, target capture",
              "`ceilings`: bf16 matmul TFLOP/s and copy GB/s; `mask`: our block mask's build against "
              "create_block_mask; `attention`: compiled flex against sdpa with the dense mask, forward + backward; "
              "`target`: the target's capture of the drafter's layers, eager and compiled.",
              ["bf16 TFLOP/s", "copy GB/s", "mask ms", "create_block_mask ms", "flex fwd+bwd ms", "sdpa fwd+bwd ms",
               "capture ms", "capture compiled ms", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        if not isinstance(doc, dict) or not any(isinstance(doc.get(k), dict) and "error" not in doc[k]
                                                for k in ("ceilings", "mask", "attention", "target")):
            continue
        c, m, a, tg = (doc.get(k) if isinstance(doc.get(k), dict) else {} for k in ("ceilings", "mask", "attention",
                                                                                    "target"))
        t.rows.append([f(c.get("bf16_matmul_tflops"), 1), f(c.get("copy_gbps"), 1), f(m.get("ours_ms"), 3),
                       f(m.get("create_block_mask_ms"), 3), f(a.get("flex_fwd_bwd_ms"), 3),
                       f(a.get("sdpa_dense_fwd_bwd_ms"), 3), f(tg.get("capture_ms")), f(tg.get("capture_compiled_ms")),
                       tree_of(p, doc), where(p, results)])
    return t


def fp8_table(results: Path) -> Table:
    t = Table("FP8 besides the drafter's layers (`--sections fp8`)",
              "The LM head's FP8 copies against bf16 (logits and input gradient of one loss chunk, training's fused "
              "loss), and the target's captured forward with FP8 weights (`train.fp8_target`), compiled; relative "
              "errors against bf16.",
              ["logits ms bf16 / fp8", "input grad ms bf16 / fp8", "fused loss ms bf16 / fp8", "loss rel diff",
               "capture compiled ms bf16 / fp8", "features rel err", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        x = doc.get("fp8") if isinstance(doc, dict) else None
        if not isinstance(x, dict) or "error" in x:
            continue
        h, g = x.get("head") or {}, x.get("target") or {}
        t.rows.append([f"{f(h.get('logits_bf16_ms'), 3)} / {f(h.get('logits_fp8_ms'), 3)}",
                       f"{f(h.get('input_grad_bf16_ms'), 3)} / {f(h.get('input_grad_fp8_ms'), 3)}",
                       f"{f(h.get('fused_loss_bf16_ms'))} / {f(h.get('fused_loss_fp8_ms'))}",
                       f(h.get("fused_loss_rel_diff"), 6),
                       f"{f(g.get('capture_bf16_compiled_ms'))} / {f(g.get('capture_fp8_compiled_ms'))}",
                       f(g.get("fp8_compiled_rel_err"), 4), tree_of(p, doc), where(p, results)])
    return t


def step_parts_table(results: Path) -> Table:
    t = Table("Memory-bound parts of the bf16 step (`--sections step_parts`)",
              "Each part alone at its real size; floor: its bytes at the measured copy bandwidth.",
              ["part", "ms", "GB moved", "TB/s", "floor ms", "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        sp = doc.get("step_parts") if isinstance(doc, dict) else None
        if not isinstance(sp, dict):
            continue
        for name, m in sp.items():
            if isinstance(m, dict) and "ms" in m:
                t.rows.append([name, f(m["ms"], 3), f(m.get("gb"), 3), f(m.get("tb_per_s"), 3),
                               f(m.get("floor_ms"), 3), tree_of(p, doc), where(p, results)])
    return t


def flex_table(results: Path) -> Table:
    t = Table("Flex kernel options of the drafter's attention (`--sections flex_tune`)",
              "torch's default against the best forward and the best backward option set (tiles, warps, stages).",
              ["shape", "default fwd ms", "default bwd ms", "best fwd", "its fwd ms", "best bwd", "its bwd ms",
               "tree", "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        ft = doc.get("flex_tune") if isinstance(doc, dict) else None
        if not isinstance(ft, dict):
            continue
        for shape, r in ft.items():
            rows, d = r.get("rows") or {}, (r.get("rows") or {}).get("default") or {}
            bf, bb = r.get("best_fwd"), r.get("best_bwd")
            t.rows.append([shape, f(d.get("fwd_ms"), 3), f(d.get("bwd_ms"), 3), bf,
                           f((rows.get(bf) or {}).get("fwd_ms"), 3), bb, f((rows.get(bb) or {}).get("bwd_ms"), 3),
                           tree_of(p, doc), where(p, results)])
    return t


def profile_table(results: Path) -> Table:
    t = Table("Where a training step goes (`--sections profile`)",
              "The train stage under torch.profiler, its trace reduced by bench/traces.py: the window's ms per "
              "step and GPU busy fraction, and each stream's kernel ms per step by group (a later reduction of the "
              "same trace, `*-groups.json`, where there is one).",
              ["run", "window", "ms per step", "GPU busy", "drafter stream ms/step", "other streams ms/step", "tree",
               "file"])
    for p in files(results, "*/*.json"):
        doc = load(p)
        pr = doc.get("profile") if isinstance(doc, dict) else None
        if not isinstance(pr, dict) or not isinstance(pr.get("trace"), dict):
            continue
        trace = regrouped(p) or pr["trace"]
        for g in (trace.get("gpus") or {}).values():
            by_role = {"drafter": [], "other": []}
            for s in (g.get("streams") or {}).values():
                ms = s.get("group_ms_per_step") or {}
                by_role["drafter" if s.get("role") == "drafter" else "other"].append(
                    ", ".join(f"{k} {f(v, 1)}" for k, v in ms.items()) or f"busy {f(s.get('busy_ms'), 1)} ms")
            w = pr.get("window") or {}
            t.rows.append([pr.get("run", "1t1d"), f"steps {w.get('start_step')}+{w.get('steps')}",
                           f(g.get("window_ms_per_step"), 1), f(g.get("busy_fraction"), 4),
                           "; ".join(by_role["drafter"]), "; ".join(by_role["other"]), tree_of(p, doc),
                           where(p, results)])
    return t


def regrouped(p: Path) -> dict | None:
    """The later reduction of a profile's trace beside it: <stem>-groups.json, or without the stem's short hash."""
    stem = p.name[:-len(".json")]
    for name in (f"{stem}-groups.json", f"{SHORT.sub('', stem)}-groups.json"):
        if (p.parent / name).exists():
            return load(p.parent / name)
    return None


def regen_table(results: Path) -> Table:
    t = Table("Regeneration (`bench/regen.py`)",
              "Generated tokens per second of the `hf` engine's variants on the random Qwen3-8B-shaped target "
              "(bf16, greedy, a fixed count of new tokens per prompt); decode step and prefill from the timed pass's "
              "CUDA events where measured.",
              ["variant", "batch", "attention", "tok/s", "decode step ms", "prefill ms", "warm-up s", "peak GB",
               "prompts x new", "tree", "file"])
    for p in files(results, "*/regen*.json"):
        doc = load(p)
        cfg = doc.get("config") or {}
        for r in doc.get("results") or []:
            ph = r.get("phases") if isinstance(r.get("phases"), dict) else {}
            t.rows.append([r.get("variant"), r.get("batch_size"), r.get("attn_implementation"),
                           f(r.get("tokens_per_s"), 1) if "tokens_per_s" in r else f"error: {r.get('error', '')[:80]}",
                           f(ph.get("decode_step_ms"), 2), f(ph.get("prefill_ms"), 0), f(r.get("warmup_s"), 1),
                           f(r.get("peak_gb"), 1), f"{cfg.get('prompts')} x {cfg.get('new_tokens')}",
                           tree_of(p, doc), where(p, results)])
    return t


def quality_table(results: Path) -> Table:
    t = Table("Drafter quality (the quality bench's records)",
              "Each recipe's run on `config/quality.yaml`'s code target and data; mode: time (equal shared GPU "
              "time), steps (equal steps) or solo. tau on the held-out prompts at temperature 0 and 1; vs seeds: tau "
              "minus the bf16 seeds' mean, whose spread (max - min) a lever must beat.",
              ["recipe", "mode", "steps", "train s", "Ktok/s", "tau T=0", "speed-up T=0", "tau T=1", "vs seeds tau",
               "seed spread tau", "status", "tree", "file"])
    for p in files(results, "*/quality.json"):
        doc = load(p)
        mode = doc.get("mode") or "time"
        for r in doc.get("rows") or []:
            t.rows.append([r.get("recipe"), mode, r.get("steps"), f(r.get("train_seconds"), 1),
                           f(r.get("ktok_per_s")), f(r.get("tau_t0"), 3), f(r.get("speedup_t0")), f(r.get("tau_t1"), 3),
                           f(r.get("tau_t0_vs_baseline"), 3), f(doc.get("baseline_seed_spread_t0"), 3),
                           r.get("status"), tree_of(p, doc), where(p, results)])
    return t


def archived(path: Path, name: str) -> dict | None:
    """A JSON member of a tar.gz (None when absent)."""
    with tarfile.open(path) as tar:
        try:
            return json.load(tar.extractfile(name))
        except KeyError:
            return None


def target_table(results: Path) -> Table:
    t = Table("The code target and its data (`config/quality.yaml`)",
              "The target pre-trained here on Python source (`build.json`) and the data regenerated by it "
              "(`manifest.json`), as archived by the former quality bench (`runs*.tar.gz`).",
              ["GPU", "pretrain steps", "pretrain s", "pretrain tok/s", "held-out perplexity", "target stage s",
               "samples", "tokens", "supervised tokens", "regenerated tok/s", "tree", "file"])
    for p in files(results, "*/runs*.tar.gz"):
        b = archived(p, "target/code/build.json")
        m = archived(p, "data/code-completion/manifest.json") or {}
        if not b:
            continue
        pre, regen = b.get("pretrain") or {}, m.get("regeneration") or {}
        t.rows.append([pre.get("gpu"), pre.get("steps"), f(pre.get("seconds"), 1), f(pre.get("tokens_per_s"), 0),
                       f((b.get("heldout") or {}).get("perplexity"), 3), f(b.get("seconds"), 1), m.get("num_samples"),
                       m.get("total_tokens"), m.get("supervised_tokens"), f(regen.get("tokens_per_s"), 1),
                       tree_of(p, beside(p)), where(p, results)])
    return t


def archived_metrics(path: Path) -> dict[str, list[dict]]:
    """{run: metrics.jsonl rows} of the runs/<run>/metrics.jsonl files in a tar.gz."""
    out = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 3 and parts[0] == "runs" and parts[2] == RunFolder.METRICS:
                out[parts[1]] = [json.loads(x) for x in tar.extractfile(m).read().decode().splitlines() if x.strip()]
    return out


def tau_table(results: Path) -> Table:
    t = Table("tau while training (`train.eval_every`)",
              "The in-training evaluations of each archived run (`runs*.tar.gz`, metrics.jsonl): tau on the held-out "
              "prompts at temperature 0, at the training time it was measured (GPU-seconds, evaluations left out; "
              "optimizer steps for rows from before the field).",
              ["run", "axis", "tau at (time)", "last tau", "tree", "file"])
    from dflash.report.plots import tau_points, time_key
    for p in files(results, "*/runs*.tar.gz"):
        for run, rows in sorted(archived_metrics(p).items()):
            key = time_key(rows)
            pts = sorted(tau_points(rows, key))
            if pts:
                t.rows.append([run, key or "step", ", ".join(f"{f(y, 3)} ({f(x, 1)})" for x, y in pts),
                               f(pts[-1][1], 3), tree_of(p, beside(p)), where(p, results)])
    return t


def features_table(results: Path) -> Table:
    t = Table("FP8 target features on the code target (`bench/fp8_features.py`)",
              "The pre-trained code target's captured layers over the held-out conversations, FP8 weights against "
              "bf16: ||f_fp8 - f_bf16|| / ||f_bf16||.",
              ["rel err", "per layer", "conversations", "tokens", "tree", "file"])
    for p in files(results, "*/quality.json"):
        doc = load(p)
        x = doc.get("fp8_features")
        if isinstance(x, dict) and "rel_err" in x:
            t.rows.append([f(x["rel_err"], 4), ", ".join(f"{k}: {f(v, 4)}" for k, v in x["rel_err_per_layer"].items()),
                           x.get("conversations"), x.get("tokens"), tree_of(p, doc), where(p, results)])
    return t


def data_table(results: Path) -> Table:
    t = Table("Data stage at scale (`bench/data_scale.py`, CPU)",
              "N synthetic conversations through `python -m dflash data` (no regeneration); peak RSS of the stage "
              "and its workers.", ["conversations", "seconds", "conversations/s", "peak RSS MB", "samples",
                                  "num_proc", "file"])
    for p in files(results, "*/data_scale*.json"):
        for r in load(p).get("results") or []:
            t.rows.append([r.get("conversations"), f(r.get("seconds"), 1), f(r.get("conversations_per_s"), 1),
                           f(r.get("peak_rss_mb"), 1), r.get("samples"), r.get("num_proc"), where(p, results)])
    return t


TABLES = (e2e_table, restart_table, multi_gpu_tables, specforge_table, variants_table, loss_table, micro_table,
          fp8_table, step_parts_table, flex_table, profile_table, regen_table, quality_table, tau_table,
          target_table, features_table, data_table)
HEAD = """# Benchmarks

Generated by `python bench/tables.py --write docs/benchmarks.md` from the JSON committed under `bench/results/`
(each row names its file; do not edit by hand: `tests/unit/test_bench_tables.py` fails when this file is not what the JSON
gives). Each results folder's README.md has the session's commands and reading of the figures; the runs are also a
history that `python -m dflash report` reads (`python bench/history.py`). Throughput from different machines of the
same kind agrees only within a few percent: compare runs of one session.

"""


def render(results: Path = REPO / "bench" / "results") -> str:
    out = HEAD
    for make in TABLES:
        made = make(results)
        for table in made if isinstance(made, list) else [made]:
            out += table.render()
    return out.rstrip("\n") + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(REPO / "bench" / "results"))
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    args = p.parse_args(argv)
    text = render(Path(args.results))
    if args.write:
        Path(args.write).write_text(text)
        return 0
    current = Path(args.check).read_text() if Path(args.check).exists() else ""
    if current != text:
        print(f"{args.check} is not what bench/results/ gives: python bench/tables.py --write {args.check}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
