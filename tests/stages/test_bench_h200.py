"""bench/h200.py on the CPU: its arguments and registry of sections (options from --opt, else the BENCH_* variable,
else the default), its shapes read from the config, a whole small run through main, the loss comparison (every
variant computes training's loss and gradient), SpecForge's step when its wheel is installed, and the profile path:
train.profile writes a trace of the window, which reduce_trace turns into GPU busy time, idle gaps and host syncs
(here on a hand-made trace)."""
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support.train import prepared, run_dir
from bench import shapes, traces
from bench.common import Job
from bench.sections import drafter, e2e, loss
from dflash.cli import main

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_h200", REPO / "bench" / "h200.py")
h200 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h200)


def test_sections_are_checked():
    args = h200.parse_args(["--sections", "specforge,loss,profile", "--steps", "5", "--opt", "loss.reps=2"])
    assert args.sections == ["specforge", "loss", "profile"] and args.opts == {("loss", "reps"): "2"}
    assert h200.parse_args([]).sections == ["ceilings", "mask", "attention", "loss", "drafter_variants", "target",
                                            "e2e"]   # the default set, as before the registry
    for bad in (["--sections", "loss,nope"], ["--opt", "loss.nope=1"], ["--opt", "nope.reps=1"], ["--opt", "loss"]):
        with pytest.raises(SystemExit):
            h200.parse_args(bad)


def test_an_option_is_opt_else_its_variable_else_its_default(monkeypatch):
    """The BENCH_* variables of the commands recorded in bench/results/ still set the options; --opt wins."""
    sec = h200.REGISTRY.by_name["e2e"]
    monkeypatch.delenv("BENCH_E2E_RUNS", raising=False)
    monkeypatch.delenv("BENCH_SKIP_STAGES", raising=False)
    assert h200.REGISTRY.options(sec, {}) == {"runs": "", "skip_stages": ""}
    monkeypatch.setenv("BENCH_E2E_RUNS", "1t1d,restart")
    assert h200.REGISTRY.options(sec, {})["runs"] == "1t1d,restart"
    assert h200.REGISTRY.options(sec, {("e2e", "runs"): "long"})["runs"] == "long"


def test_shapes_are_the_configs():
    """The micro-benchmarks' shapes come from config/h200.yaml (and h200-long.yaml), not from constants: the issue's
    Qwen3-8B shapes, and a config override moves them."""
    sh = shapes.load()
    d = sh.drafter_config()
    assert (sh.context, sh.anchors, sh.block, sh.hidden, sh.vocab, sh.loss_chunk) == (3072, 512, 16, 4096, 151936, 4096)
    assert (d.num_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size) == \
        (5, 32, 8, 128, 12288)
    assert sh.capture_layers == [1, 9, 17, 25, 33] and sh.gamma == 7.0
    assert shapes.issue_shapes() == [(3072, 512), (8192, 1024), (16384, 2048)]
    assert shapes.load(shapes.H200, {"train.num_anchors": 256}).anchors == 256
    ctx = sh.run_context("sdpa", False)   # the context factory: keywords, no target folder or data needed
    assert (ctx.backend, ctx.compile, ctx.gamma, ctx.drafter_config.hidden_size, ctx.cfg.train.num_anchors) == \
        ("sdpa", False, 7.0, 4096, 512)


def small_config(tmp_path) -> Path:
    """config/h200.yaml shrunk to CPU size (buckets 128/256, 8 anchors, a 64-wide 8-layer target, vocab 512)."""
    doc = yaml.safe_load((REPO / shapes.H200).read_text())
    doc["data"].update(bucket_edges=[128, 256], max_length=256, synthetic={"enabled": True, "num_samples": 8,
                                                                          "lengths": [128, 256]})
    doc["target"]["arch"].update(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=1024)
    doc["train"].update(num_anchors=8, loss_chunk=64, targets=["cpu"], drafters=["cpu"], attention="sdpa",
                        compile=False, compile_target=False)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_run_records_its_envelope_options_and_each_section(tmp_path, monkeypatch):
    """main on the CPU, on a shrunk config: bench.json starts with the envelope (command with its BENCH_* variable,
    device, versions, tree), records each section's options as used, and the sections' figures at the config's
    shapes; an unknown section is refused before anything runs."""
    monkeypatch.setenv("BENCH_LOSS_REPS", "3")
    out = tmp_path / "out"
    assert h200.main(["--out", str(out), "--config", str(small_config(tmp_path)), "--sections", "mask,loss",
                      "--opt", "loss.reps=1"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["command"].startswith("BENCH_LOSS_REPS=3 ") and "--opt loss.reps=1" in doc["command"]
    assert doc["device"] == "cpu" and doc["torch"] == torch.__version__ and len(doc["tree"]["hash"]) == 16
    assert doc["options"] == {"loss": {"reps": "1"}}          # --opt over the variable
    assert doc["mask"]["same_tiles"] is True
    assert doc["loss"]["shape"] == {"positions": 8 * 16, "scored": doc["loss"]["shape"]["scored"], "hidden": 64,
                                    "vocab": 512, "chunk": 64}
    assert doc["loss"]["fused"]["agrees"] is True and doc["loss"]["torch_full"]["agrees"] is True
    assert doc["mask_section_s"] >= 0 and doc["loss_section_s"] >= 0


def test_specforge_is_given_the_configs_shapes():
    """SpecForge's step is built from the same config as ours (its test needs the wheel; this one does not): every
    model argument of specforge_step, from config/h200.yaml."""
    import inspect
    theirs = drafter.specforge_shape(shapes.load())
    params = set(inspect.signature(drafter.specforge_step).parameters) - {"num_anchors", "feats", "ids", "loss_mask",
                                                                            "attention"}
    assert set(theirs) == params
    assert theirs == {"vocab": 151936, "layers": 5, "heads": (32, 8, 128), "inter": 12288, "target_layers": 36,
                      "context_layers": 5, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_positions": 40960,
                      "mask_id": 151669, "block": 16, "gamma": 7.0, "lr": 6e-4}


def test_the_drafter_step_module_leaves_dflash_to_the_base_tree():
    """drafter_variants' `base:` processes import bench.sections.drafter, then put another tree's dflash first on
    sys.path: nothing bench imports at module level may have imported dflash already."""
    code = ("import sys; sys.path.insert(0, %r); from bench.sections import drafter; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dflash'))" % str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
    assert drafter.variant_sets("flex+compile:chunk=2048:casts=recompute", 512) == (
        "flex", True, {"train.num_anchors": 512, "train.loss_chunk": 2048, "train.recompute_weight_casts": True})
    assert drafter.variant_sets("flex+compile:train.precision=fp8:train.fp8_lm_head=true", 512) == (
        "flex", True, {"train.num_anchors": 512, "train.precision": "fp8", "train.fp8_lm_head": True})


def test_loss_variants_agree_with_training_loss():
    hidden, head, labels, weights = loss.loss_problem(q=32 * 8, s=200, h=32, v=300, bk=8)
    res = loss.loss_compare(hidden, head, labels, weights, bk=8, chunk=64, reps=1, compiled=False)
    for name in ("torch_chunked_checkpointed", "torch_full"):
        assert res[name]["agrees"] is True, res[name]
        assert res[name]["loss_abs_diff"] < 1e-4 and res[name]["grad_max_abs_diff"] < 1e-2 * res[name]["grad_max_abs"]
    assert res["fused"]["loss"] == pytest.approx(res["torch_full"]["loss"], rel=1e-4) and res["fused"]["loss"] > 1
    assert res["fastest_agreeing"] in ("fused", "torch_chunked_checkpointed", "torch_full")


def test_specforge_step_runs_on_cpu():
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 128, 5 * 32, generator=g), torch.randint(0, 200, (1, 128), generator=g)
    step = drafter.specforge_step(8, feats, ids, torch.ones(1, 128, dtype=torch.bool), vocab=200, layers=1,
                                  heads=(2, 1, 16), inter=64, target_layers=36, context_layers=5, rope_theta=1e6,
                                  rms_norm_eps=1e-6, max_positions=4096, mask_id=199, block=16, gamma=7.0, lr=6e-4,
                                  attention="sdpa")
    losses = [float(step()) for _ in range(2)]
    assert all(4 < x < 7 for x in losses)   # about log(200): a real CE over the vocabulary


def test_profile_window_writes_a_trace(tmp_path):
    cfg = prepared(tmp_path, steps=5, drafters=["cpu"], checkpoint_every=0, profile={"start_step": 2, "steps": 2})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    res = traces.reduce_trace(run_dir(cfg) / "profile.json.gz")
    assert res["steps"] == 2 and res["phases"]["drafter_fwd_bwd"]["count_cpu"] == 2
    assert res["gpus"] == {}   # CPU run: no kernels


def test_reduce_trace_finds_busy_time_gaps_and_syncs(tmp_path):
    def x(cat, name, ts, dur, pid=0, tid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    ev = [x("kernel", "gemm", 0, 1000), x("kernel", "gemm", 500, 1000, tid=9),       # overlap: busy 0..1500
          x("gpu_user_annotation", "drafter_fwd_bwd", 0, 1500, tid=7),
          x("kernel", "softmax", 4500, 500),                                       # 3 ms idle before it
          x("kernel", "tiny", 5100, 100, tid=9),                                   # 0.1 ms gap: not listed
          x("user_annotation", "optimizer", 1400, 3200, pid=1, tid=1),
          x("cuda_runtime", "cudaStreamSynchronize", 1600, 2800, pid=1, tid=1),
          x("cpu_op", "aten::item", 1550, 2900, pid=1, tid=1)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    r = traces.reduce_trace(path)
    g = r["gpus"]["0"]
    assert g["window_ms"] == 5.2 and g["busy_ms"] == 2.1 and g["busy_fraction"] == pytest.approx(2.1 / 5.2, abs=1e-4)
    assert g["streams"]["7"]["role"] == "drafter" and g["streams"]["9"]["role"] == "other (target)"
    assert g["streams"]["7"]["group_ms_per_step"] == {"gemm": 1.0, "sampling": 0.5}     # one step (one optimizer)
    assert g["streams"]["9"]["group_ms_per_step"] == {"gemm": 1.0, "other": 0.1}
    # the two gemms share 0.5 ms; the softmax and the tiny kernel run alone
    assert g["streams"]["7"]["group_overlapped_ms_per_step"] == {"gemm": 0.5, "sampling": 0.0}
    assert g["streams"]["9"]["group_overlapped_ms_per_step"] == {"gemm": 0.5, "other": 0.0}
    assert g["idle_gaps_over_ms"]["count"] == 1 and g["idle_gaps_over_ms"]["longest"][0]["ms"] == 3.0
    assert g["idle_gaps_over_ms"]["longest"][0]["cpu"] == ["optimizer", "aten::item", "cudaStreamSynchronize"]
    assert g["top_kernels"][0] == {"name": "gemm", "count": 2, "ms": 2.0, "share": pytest.approx(2 / 2.6, abs=1e-4)}
    assert r["host_syncs"]["cudaStreamSynchronize"] == {"count": 1, "ms": 2.8} and r["steps"] == 1


def test_specforge_computes_our_loss_with_our_weights_and_anchors():
    """The comparison is like for like: SpecForge's OnlineDFlashModel, given our drafter's weights and anchors,
    computes our loss and our gradients (same layers, mask, positions, RoPE, weights exp(-(k-1)/gamma))."""
    from support.model import make_batch, make_drafter, tiny_cfg
    from dflash.model import block_labels, dflash_loss
    fam, draft, _, _ = drafter.load_specforge()
    cfg = tiny_cfg(block_size=16, max_position_embeddings=4096)
    ours = make_drafter(cfg, dtype=torch.float64)
    hidden, ids, lm, anchors = make_batch(cfg, 1, 96, 5, dtype=torch.float64, supervised=1.0)
    labels, weights = block_labels(ids, lm, anchors, 7.0)
    loss = dflash_loss(ours(hidden, ids, anchors, backend="sdpa"), ours.lm_head_weight, labels, weights, 16).loss
    loss.backward()
    from transformers import Qwen3Config
    qc = Qwen3Config(**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps")},
                     num_hidden_layers=cfg.num_layers, rope_theta=cfg.rope_theta, max_position_embeddings=4096)
    qc.block_size, qc.num_target_layers, qc._attn_implementation = 16, cfg.num_target_layers, "sdpa"
    qc.dflash_config = {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}
    theirs = draft.DFlashDraftModel(qc).double()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    embed = torch.nn.Embedding.from_pretrained(ours.embed_weight.detach().clone())
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).double()
    head.weight.data.copy_(ours.lm_head_weight)
    wrapped = fam.OnlineDFlashModel(theirs, head, embed, mask_token_id=cfg.mask_token_id, block_size=16,
                                    attention_backend="sdpa", num_anchors=5, loss_decay_gamma=7.0)
    wrapped._sample_anchor_positions = lambda *a: (anchors.pos, anchors.valid)
    their_loss = wrapped(input_ids=ids, hidden_states=hidden, loss_mask=lm.double())[0]
    their_loss.backward()
    assert their_loss.item() == pytest.approx(loss.item(), rel=1e-9)
    for name in ("fc.weight", "layers.0.self_attn.k_proj.weight", "layers.1.mlp.down_proj.weight"):
        torch.testing.assert_close(dict(theirs.named_parameters())[name].grad, dict(ours.named_parameters())[name].grad)


def test_e2e_run_table_loads_every_config():
    """Each e2e run's config and --set arguments load as the train stage loads them (a dry run of the table)."""
    from dflash import config as C
    runs = e2e.e2e_runs()
    assert set(e2e.OPT_IN) <= set(runs)
    for name, (path, sets) in runs.items():
        items = (sets or [])[1::2]
        assert (sets or [])[0::2] == ["--set"] * len(items), name
        cfg = C.load(REPO / path, {k: C.parse_value(v, f"--set {i}") for i in items
                                   for k, _, v in [i.partition("=")]}).cfg
        assert cfg.train.compile_target is (path == shapes.H200 and name != "1t1d-eager"), name
        if name == "1t1d-eager":   # 1t1d with the target eager: one GPU, one target and one drafter thread
            assert (path, tuple(cfg.train.targets), tuple(cfg.train.drafters), cfg.train.runtime) == \
                (shapes.H200, ("cuda:0",), ("cuda:0",), "threads")


def test_fp8_variants_are_config_keys_of_the_h200_config():
    """Each drafter-step precision variant of the specforge section loads over config/h200.yaml as our_step loads it."""
    from dflash import config as C
    assert drafter.FP8_VARIANTS["bf16"] == {}
    for name, sets in drafter.FP8_VARIANTS.items():
        t = C.load(REPO / shapes.H200, {"train.num_anchors": 512, **sets}).cfg.train
        assert (t.precision, t.fp8_lm_head) == (sets.get("train.precision", "bf16"),
                                                 sets.get("train.fp8_lm_head", False)), name


def test_profile_takes_its_run_from_the_e2e_table(tmp_path, monkeypatch):
    """Option profile.run (BENCH_PROFILE_RUN) names an e2e run (its config and --set keys): an unknown name is refused
    before any stage."""
    def job(**opts):
        return Job(tmp_path, {"run": "1t1d", "window": "10,5", "skip_stages": "", **opts})
    res = e2e.profile(job(run="1t1d-fp16"))
    assert "unknown BENCH_PROFILE_RUN 1t1d-fp16" in res["error"] and "1t1d-fp8all" in res["error"]
    assert "restart" not in res["error"]   # the warm restart has no --set keys of its own
    calls = []
    monkeypatch.setattr(e2e, "dflash_stage", lambda *a: calls.append(a) or (type("R", (), {"returncode": 1,
                                                                                          "stderr": "x"})(), 0.0))
    res = e2e.profile(job(run="1t1d-fp8all", skip_stages="1"))
    assert res["run"] == "1t1d-fp8all" and res["exit"] == 1
    args = calls[0]
    assert "train.fp8_target=true" in args and "train.eval_every=0" in args and args[2] == "config/h200.yaml"


def test_step_parts_measures_every_part_against_its_floor():
    sh = shapes.load(shapes.H200, {"target.arch.hidden_size": 64, "target.arch.num_attention_heads": 4,
                                   "target.arch.num_key_value_heads": 2, "target.arch.head_dim": 16,
                                   "target.arch.intermediate_size": 128, "target.arch.vocab_size": 512})
    out = loss.step_parts(sh, copy_gib=0.01, rows=64, compiled=False)
    n = out["trainable_params"]
    # 5 layers (q, o 64x64; k, v 64x32: 2 KV heads of dim 16; gate, up, down 64x128; q/k norms 16 each; two norms
    # 64 each), fc 5*64 -> 64, the context and final norms
    assert n == 5 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 16 + 2 * 64) + 5 * 64 * 64 + 2 * 64
    assert out["adamw_fused"]["gb"] == round(n * 28 / 1e9, 3) and "adamw_foreach_compiled" not in out
    for part in ("copy", "adamw_fused", "adamw_foreach", "adamw_clip", "grad_norm", "casts_fwd", "casts_grad", "loss_kernel",
                 "loss_reduction"):
        r = out[part]
        assert r["ms"] > 0 and r["tb_per_s"] == pytest.approx(r["gb"] / r["ms"], rel=0.05, abs=2e-3), part
        assert r["floor_ms"] == pytest.approx(r["gb"] / out["copy"]["tb_per_s"], rel=0.05, abs=2e-3), part


def test_base_tree_writes_another_commits_tree(tmp_path):
    """bench/base_tree.sh REV: REV's tracked files (not the working tree's) into .base/, its hash in BASE_REV; a
    revision that is not a commit is refused, naming it."""
    import shutil
    import subprocess
    repo = tmp_path / "r"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "base_tree.sh", repo / "bench")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "a.txt").write_text("one\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    first = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "a.txt").write_text("two\n")
    subprocess.run(git + ["commit", "-qam", "two"], check=True)
    (repo / "a.txt").write_text("uncommitted\n")
    r = subprocess.run(["bash", str(repo / "bench" / "base_tree.sh"), first[:8]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (repo / ".base" / "a.txt").read_text() == "one\n"
    assert (repo / ".base" / "BASE_REV").read_text().strip() == first
    r = subprocess.run(["bash", str(repo / "bench" / "base_tree.sh"), "nosuchrev"], capture_output=True, text=True)
    assert r.returncode == 2 and "nosuchrev is not a commit" in r.stderr


def test_e2e_runs_the_named_runs_and_keeps_each_summary_with_the_tree(tmp_path, monkeypatch):
    """The e2e section without a GPU: the train stage replaced by one that writes what it writes (summary.json,
    metrics.jsonl); the runs named by the option run in the table's order, each summary is copied out with the
    bench's command and tree (`bench`, which bench/history.py reads), and the warm restart reads its first step."""
    calls = []

    def stage(*args):
        calls.append(args)
        if args[0] == "train":
            name = next(a.split("=", 1)[1] for a in args if a.startswith("run_name="))
            run = tmp_path / "results" / "runs" / name
            run.mkdir(parents=True, exist_ok=True)
            (run / "summary.json").write_text(json.dumps({
                "run_id": name, "steps": 3, "throughput": {"ktok_per_s": 12.5}, "status": "completed",
                "compile": {"graphs": 4, "warmup_s": 2.0, "cache_hits": 4, "per_device": [{"device": "cuda:0"}]},
                "seconds_to_first_step": 9.5}))
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "elapsed_s": 0.25}) + "\n")
        return type("R", (), {"returncode": 0, "stderr": "log"})(), 1.0
    monkeypatch.setattr(e2e, "dflash_stage", stage)
    monkeypatch.setattr(e2e, "REPO", tmp_path)
    record = {"command": "python3 bench/h200.py --sections e2e", "tree": {"hash": "0" * 16, "commit": "c" * 40}}
    res = e2e.e2e(Job(tmp_path, {"runs": "restart,1t1d-fp8", "skip_stages": ""}, steps=3, record=record))
    assert [a[0] for a in calls] == ["target", "data", "train", "train"]      # stages once, then the table's order
    assert "run_name=h200-restart" in calls[2] and "train.precision=fp8" in calls[3] and "train.steps=3" in calls[3]
    assert res["1t1d-fp8"]["throughput"] == {"ktok_per_s": 12.5} and "per_device" not in res["1t1d-fp8"]["compile"]
    assert res["warm_restart"] == {"wall_s": 1.0, "first_logged_step_elapsed_s": 0.25, "exit": 0,
                                   "seconds_to_first_step": 9.5, "warmup_s": 2.0, "cache_hits": 4, "graphs": 4}
    kept = json.loads((tmp_path / "summary-1t1d-fp8.json").read_text())
    assert kept["bench"] == record and kept["run_id"] == "h200-1t1d-fp8"
    calls.clear()   # a misspelt run (1t1d-tc: renamed 1t1d since config/h200.yaml compiles the target) runs nothing
    res = e2e.e2e(Job(tmp_path, {"runs": "1t1d,1t1d-tc", "skip_stages": "1"}, steps=3))
    assert calls == [] and "unknown BENCH_E2E_RUNS / e2e.runs 1t1d-tc" in res["error"]


def test_old_vs_new_refuses_without_a_base_tree(tmp_path):
    """bench/old_vs_new.sh needs .base/ (bench/base_tree.sh): without it, one line and exit 2, nothing run."""
    import shutil
    import subprocess
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "old_vs_new.sh", tmp_path / "bench")
    r = subprocess.run(["bash", "bench/old_vs_new.sh", "out", "1t1d"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "old_vs_new: no .base/ (bash bench/base_tree.sh REV first)"
    assert not (tmp_path / "out").exists()
