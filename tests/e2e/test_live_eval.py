"""tau measured while training (train.eval_every, dflash/evaluate/live.py): which steps evaluate, the last one equal
to the evaluate stage's tau on the final checkpoint, nothing of training changed by it (weights, RNG, recompiles),
its fields in metrics.jsonl, summary.json and the report's training plot; the distributed runtime's split layout
refused (its co-located ranks evaluate in tests/e2e/test_distributed.py's co-located run)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dflash import config as C
from dflash.cli import main
from dflash.evaluate.live import due, settings
from support.data import build_tiny_target
from support.train import EVAL, ckpt, prepared_eval, run_dir, train_ok

def rows(cfg) -> list[dict]:
    return [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]


def test_schedule_and_settings():
    assert [s for s in range(1, 12) if due(4, s, s == 11)] == [4, 8, 11]     # every 4 steps and the last
    assert [s for s in range(1, 9) if due(4, s, s == 8)] == [4, 8]            # the last once, when it is due anyway
    assert not any(due(0, s, s == 8) for s in range(1, 9))                    # 0 is off, the last step too
    assert settings(C.from_dict({}).cfg) == (16, 64)       # null: the evaluate stage's num_prompts, max_new_tokens
    assert settings(C.from_dict({"evaluate": {"num_prompts": 5, "max_new_tokens": 9}}).cfg) == (5, 9)
    assert settings(C.from_dict({"train": {"eval_prompts": 2, "eval_max_new_tokens": 7},
                                 "evaluate": {"num_prompts": 5}}).cfg) == (2, 7)
    assert C.result_hash({"train": {"eval_every": 3}}) == C.result_hash({})   # decoding changes no trained weight


@pytest.mark.slow
def test_final_tau_equals_the_evaluate_stage_and_training_is_unchanged(tmp_path):
    """Threads runtime, 2 replicas, steps 1..7 with eval_every 3: tau at steps 3, 6 and 7 (the last), each in a row of
    its own (whatever train.log_every) and in summary.json; the last equals `evaluate`'s tau on the final checkpoint
    (same prompts, tokens, weights); the weights, the checkpoint's RNG state and the losses equal a run without it."""
    on = prepared_eval(tmp_path / "on", steps=7, log_every=2, checkpoint_every=0, eval_every=3)
    off = prepared_eval(tmp_path / "off", steps=7, log_every=2, checkpoint_every=0)
    train_ok(on)
    train_ok(off)
    got = rows(on)
    assert [(r["step"], r["tau_step"]) for r in got] == [(2, None), (3, 3), (4, None), (6, 6), (7, 7)]
    evaluated = [r for r in got if r["tau_step"] is not None]
    assert all(r["tau"] is None and r["eval_s"] is None for r in got if r["tau_step"] is None)
    assert all(1.0 <= r["tau"] <= 4 and r["eval_s"] > 0 for r in got if r["tau_step"] is not None)   # block 4
    # training seconds of every row and of each evaluation (the step it ran after), growing; no GPU-seconds on the CPU
    train_s = [r["train_s"] for r in got]
    assert train_s == sorted(train_s) and train_s[0] > 0 and all(r["gpu_s"] is None for r in got)
    assert [r["tau_train_s"] for r in evaluated] == sorted(r["tau_train_s"] for r in evaluated)
    assert got[-1]["tau_train_s"] == got[-1]["train_s"] and all(r["tau_gpu_s"] is None for r in got)
    s = json.loads((run_dir(on) / "summary.json").read_text())
    ev = s["eval"]
    assert ev["every"] == 3 and ev["evals"] == 3 and ev["steps"] == [3, 6, 7] and ev["prompts"] == 3
    assert ev["max_new_tokens"] == 12 and ev["tau"] == got[-1]["tau"] and ev["tau_history"][-1] == ev["tau"]
    assert ev["seconds"] > 0 and 0 < ev["share"] < 1 and ev["eval_over_step"] > 0
    assert ev["method"] == "replay" and [p["step"] for p in ev["curve"]] == [3, 6, 7]
    assert [p["tau"] for p in ev["curve"]] == [r["tau"] for r in evaluated] and ev["curve"][-1]["gpu_s"] is None
    assert s["compile"]["recompiles_after_warmup"] == 0 and s["replicas_identical"] is True
    assert json.loads((run_dir(off) / "summary.json").read_text())["eval"] is None

    # the evaluate stage on the final checkpoint: the same tau, exactly
    assert main(["evaluate", "--config", str(on), "--no-progress"]) == 0
    acc = json.loads((run_dir(on) / "acceptance.json").read_text())
    assert acc["checkpoint_step"] == 7 and acc["num_prompts"] == 3 and acc["max_new_tokens"] == 12
    assert acc["tau"] == got[-1]["tau"]

    # nothing of training changed: weights bit for bit, the RNG state saved with them, every loss
    a, b = (ckpt(c, 7) for c in (on, off))
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = (torch.load(p / "rng.pt", weights_only=True) for p in (a, b))
    assert torch.equal(ra["torch"], rb["torch"])
    same = {2, 6, 7}   # the rows whose intervals hold the same steps in both runs (1-2, 5-6, 7)
    assert [r["loss"] for r in got if r["step"] in same] == [r["loss"] for r in rows(off) if r["step"] in same]
    s_off = json.loads((run_dir(off) / "summary.json").read_text())
    assert [s[k] for k in ("loss", "acc_per_position", "acceptance_estimate")] == \
        [s_off[k] for k in ("loss", "acc_per_position", "acceptance_estimate")]

    # the report's training plot draws tau next to the estimate from training accuracy, against training seconds
    from dflash.report.plots import _acceptance
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    _acceptance(ax, got)
    est, tau = ax.get_lines()
    assert list(tau.get_xdata()) == [r["tau_train_s"] for r in evaluated]
    assert list(tau.get_ydata()) == [r["tau"] for r in evaluated]
    assert list(est.get_xdata()) == train_s and ax.get_xlabel() == "training seconds (CPU)"
    assert list(est.get_ydata()) == [1 + r["acceptance_estimate"] for r in got]
    fig.clf()
    ax = fig.subplots()   # on a GPU the same rows carry GPU-seconds: the axis is theirs
    _acceptance(ax, [{**r, "gpu_s": 2 * r["train_s"], "tau_gpu_s": r["tau_train_s"] and 2 * r["tau_train_s"]}
                     for r in got])
    assert list(ax.get_lines()[1].get_xdata()) == [2 * r["tau_train_s"] for r in evaluated]
    assert ax.get_xlabel().startswith("training GPU-seconds")
    plt.close(fig)


def test_the_distributed_split_layout_is_refused_naming_the_key(tmp_path, capsys):
    """The split layout (drafter ranks without a target) is refused before anything is launched, naming the key. (The
    co-located ranks' evaluation, drafter-0 decoding while drafter-1 waits, is tests/e2e/test_distributed.py's
    co-located run: one launch.)"""
    split = prepared_eval(tmp_path / "s", steps=2, eval_every=1)
    assert main(["train", "--config", str(split), "--no-progress", "--set", "train.runtime=distributed"]) == 1
    assert "train.eval_every: drafter replica 0 has no target in its process" in capsys.readouterr().err


def test_decoding_with_a_compiled_target_after_warm_up_compiles_nothing(tmp_path):
    """train.compile_target: the target's layers are compiled for the bucket shapes and recompiles forbidden; the
    evaluation's decode shapes differ, so it runs them eagerly (compile_threads.eager(), this thread only): no new
    graph, no error, the compiled capture still serves its warmed shape. Without it the same decode fails as a
    recompile. (Dynamo
    with the eager backend: the guards and the stance are dynamo's, the backend only makes the test fast.)"""
    from types import SimpleNamespace

    from support.data import target_section
    from dflash.evaluate.live import LiveEval
    from dflash.evaluate.specdec import DFlashDraft, speculative_generate
    from dflash.model import DFlashDrafter, DrafterConfig
    from dflash.target import load_target
    from dflash import compile_threads
    from dflash.train import compile_guard
    from dflash.train.features import LayerCapture

    loaded = C.from_dict({"target": target_section(build_tiny_target()), "train": {"eval_every": 1},
                          "drafter": {"num_layers": 1, "block_size": 4, "num_target_layers": 2,
                                      "target_layer_ids": [0, 1]}, "evaluate": EVAL})
    (tmp_path / "holdout.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_ids": [5 + i, 9, 11, 13]}) + "\n"
                                                    for i in range(3)))
    model = load_target(loaded.cfg.target)
    cap = LayerCapture(model, [0, 1])
    for m in cap.modules:
        m.forward = compile_threads.compiled(m.forward, fullgraph=True, dynamic=False, backend="eager")
    cap.compiled = True
    ids = torch.randint(0, 300, (1, 16))
    warm = cap.warm_up(torch.device("cpu"), [(1, 16)], 300)
    assert warm["graphs"] >= 1
    torch.manual_seed(0)
    dcfg = DrafterConfig.from_target(model.config, loaded.cfg.drafter, 3)
    drafter = DFlashDrafter(dcfg, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    compile_guard.forbid_recompiles()
    try:
        before = compile_guard.counters()["graphs"]
        ctx = SimpleNamespace(cfg=loaded.cfg, data_dir=tmp_path, placement=SimpleNamespace(gpu_count=0))
        record = LiveEval(ctx, model).evaluate(drafter, 1, 0.5)
        assert record["prompts"] == 3 and record["tau"] >= 1.0 and 0 < record["tokens"] <= 3 * 12
        assert record["train_s"] == 0.5 and record["method"] == "replay" and record["greedy_mismatches"] == 0
        assert cap.guarded(ids).shape == (1, 16, 2 * 32)          # the warmed shape: still served compiled
        assert compile_guard.counters()["graphs"] == before       # nothing compiled after the warm-up
        with pytest.raises(Exception, match="(?i)recompil"):     # the control: the same decode outside eager()
            speculative_generate(model, DFlashDraft(drafter), [5, 9, 11, 13], 12, [], 0.0, 3)
    finally:
        compile_guard.allow_compiles()


def test_what_cannot_be_evaluated_is_refused_before_anything_is_loaded():
    """train.context refuses, naming the keys: replica 0 without a target in its process (the distributed split
    layout), and an FP8-quantized target (its tau would not be the one `evaluate` measures)."""
    from types import SimpleNamespace

    from dflash.errors import UserError
    from dflash.train.context import check_live_eval
    split, coloc = SimpleNamespace(colocated=False), SimpleNamespace(colocated=True)
    dist = C.from_dict({"train": {"eval_every": 5, "runtime": "distributed"}}).cfg.train
    with pytest.raises(UserError, match="train.eval_every: .*split layout"):
        check_live_eval(dist, split)
    check_live_eval(dist, coloc)
    check_live_eval(C.from_dict({"train": {"eval_every": 5}}).cfg.train, split)        # threads: one process
    with pytest.raises(C.ConfigError, match="train.eval_every with train.fp8_target"):   # refused at config load
        C.from_dict({"train": {"eval_every": 5, "fp8_target": True}})
    check_live_eval(C.from_dict({"train": {"fp8_target": True}}).cfg.train, split)     # evaluation off: nothing to refuse
