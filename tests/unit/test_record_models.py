"""The typed models of the files that cross a stage (issue 41 item 2): the docs' tables are generated from them, the
writer's record is exactly the model, the readers' views take what they need and keep the rest."""
import hashlib
import json
import re
import shutil

import pytest
from pydantic import ValidationError

from dflash.cli import main
from dflash.data import gather, shards
from dflash.errors import UserError
from dflash.evaluate.modelcard import read_evaluation as _acceptance
from dflash.records import acceptance as acceptance_rec, checkpoint as checkpoint_rec, compile as compile_rec, manifest
from dflash.records import read, regressions, write
from dflash.report import build, history, regress
from dflash.stages import gate
from support.report_factory import acceptance, settings, summary, with_pkg, write_run


@pytest.mark.parametrize("name, table, keys", [
    ("manifest-keys", manifest.key_table, ("content_hash", "manifest_hash", "sources.<name>.rejected",
                                           "regeneration.tokens_per_s", "tokenizer.mask_token_id")),
    ("acceptance-keys", acceptance_rec.key_table, ("tau", "by_proposal", "sets.<name>.tau_prompt_mean",
                                                     "sets.<name>.plain.target_forwards", "stop_token_ids")),
    ("compile-keys", compile_rec.key_table, ("env_hash", "cache_dir", "per_role[].cache_misses",
                                                "per_role[].modules", "per_role[].shapes[].length")),
    ("regressions-keys", regressions.key_table, ("latest_regressed", "runs[].quality.baseline.tau",
                                                       "runs[].changed.<category>[].old", "runs[].anomalies[].share",
                                                       "placement.colocated_speedup", "skipped[].reason")),
    ("trainer-keys", checkpoint_rec.trainer_key_table, ("step", "data_index", "scheduler", "python_random",
                                                            "result_hash", "metrics", "finished_by")),
    ("finished-keys", checkpoint_rec.finished_key_table, ("outputs", "checkpoint.path", "checkpoint.manifest")),
])
def test_docs_list_the_keys_of_the_model(repo, name, table, keys):
    text = (repo / "docs" / "architecture.md").read_text()
    block = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert block and block.group(1) == table(), f"docs/architecture.md: paste {table.__module__}.{table.__name__}()"
    for key in keys:
        assert f"| `{key}` |" in block.group(1)


def test_manifest_writer_refuses_a_key_the_model_does_not_describe(tmp_path):
    with pytest.raises(ValidationError, match="dataset"):          # a partial record: the keys it lacks are named
        gather.write_manifest(tmp_path, {"content_hash": "0" * 16})
    assert not (tmp_path / shards.MANIFEST).exists()               # refused before anything is written
    fields = {k: f for k, f in manifest.Manifest.model_fields.items() if f.is_required()}
    assert {"files", "manifest_hash", "dataset", "sources", "tokenizer", "created_at"} <= set(fields)


def _manifest_body() -> dict:
    """A whole manifest as the gather makes it (unsealed): a code source (its from_* counts between truncated and
    weight), regeneration on, config numbers written as integers (a weight, the temperature, the filter's keys)."""
    source = {"rows": 9, "kept": 7, "samples": 7, "holdout": 1, "truncated": 2}
    return {"dataset": "d", "content_hash": "0" * 16, "num_samples": 7, "total_tokens": 700, "supervised_tokens": 350,
            "bucket_edges": [64, 128], "buckets": {"64": 3, "128": 4}, "length_histogram": {"1-8": 7},
            "sources": {"code": {**source, "from_pretrain_files": 6, "from_heldout_files": 3, "weight": 1.0,
                                 "rejected": {"duplicate": 2}},
                        "sg": {**source, "weight": 2, "rejected": {}}},
            "holdout": 2, "regeneration": {"enabled": True, "tokens": 10, "seconds": 1.5, "tokens_per_s": 6.7,
                                           "engine": "hf", "max_new_tokens": 96, "temperature": 0,
                                           "conversations": 7, "cached": 0, "cache": "results/x", "device": "cpu"},
            "max_length": 128, "truncation": "truncate", "min_supervised_tokens": 32,
            "filters": {"too_few_supervised": {"rejected": 0, "min_supervised_tokens": 32,
                                               "keys": {"data.min_supervised_blocks": 2, "drafter.block_size": 16}},
                        "too_long": {"rejected": 0, "keys": {"data.max_length": 128, "data.truncation": "truncate"}}},
            "block_size": 16, "synthetic": False, "data_shards": 2,
            "tokenizer": {"size": 64, "vocab_size": 64, "pad_token_id": None, "eos_token_id": 2, "mask_token_id": 63},
            "target_path": "results/target", "seed": 0, "seconds": 3.25, "created_at": "2026-12-07T00:00:00Z"}


def test_the_manifest_record_writes_the_bytes_of_its_dict(tmp_path):
    """gather.write_manifest (the Manifest record through records.write) writes byte for byte what the plain dict
    writes (the key order, 2 as 2 and 1.0 as 1.0), so no manifest_hash or content moves."""
    (tmp_path / "a" / "train").mkdir(parents=True)
    (tmp_path / "a" / shards.HOLDOUT).write_text("{}\n")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    record = gather.write_manifest(tmp_path / "a", _manifest_body())
    plain = shards.write_manifest(tmp_path / "b", _manifest_body())
    assert (tmp_path / "a" / shards.MANIFEST).read_bytes() == (tmp_path / "b" / shards.MANIFEST).read_bytes()
    assert isinstance(record, manifest.Manifest) and record.manifest_hash == plain["manifest_hash"]
    assert record.sources["sg"].from_pretrain_files is None and "from_pretrain_files" not in plain["sources"]["sg"]
    assert shards.read_manifest(tmp_path / "a") == plain
    assert '"weight": 2,' in (tmp_path / "a" / shards.MANIFEST).read_text() and record.regeneration.temperature == 0


def test_manifest_reader_checks_the_types_of_the_keys_it_uses(tmp_path):
    shards.write_manifest(tmp_path, {"content_hash": "0" * 16, "num_samples": 3, "later_key": [1]})
    assert shards.read_manifest(tmp_path)["later_key"] == [1]      # an older or newer manifest's other keys pass
    shards.write_manifest(tmp_path, {"buckets": {"64": "3"}})      # sealed, but a count as a string
    with pytest.raises(UserError, match=re.escape("manifest.json: key 'buckets.64': Input should be a valid integer")):
        shards.read_manifest(tmp_path)


FIGURES = {"tau": 2.5, "verify_steps": 4, "acceptance_histogram": {"1": 1, "2": 3},
           "acceptance_distribution": {"1": 0.25, "2": 0.75}, "acceptance_per_position": [0.75],
           "speculative_tokens_per_s": 10.0, "plain_tokens_per_s": 5.0, "speedup": 2.0}
ACCEPTANCE = {**FIGURES, "run_name": "t", "created_at": "2026-01-01T00:00:00+00:00", "drafter": "ckpt",
              "checkpoint_step": 10, "target": "tgt", "target_files": {}, "device": "cpu", "dtype": "float32",
              "temperature": 0.0, "block_size": 2, "max_new_tokens": 10, "num_prompts": 1, "stop_token_ids": [2],
              "proposal": "argmax", "by_proposal": {"argmax": FIGURES}, "engines": {"argmax": ["vLLM"]},
              "lossless": True, "sets": {}}


def test_acceptance_record_is_exactly_the_model():
    """The evaluate stage validates its record before writing (tests/stages/test_evaluate_stages.py runs it at
    temperature 0 and above): a key the model does not describe, or one left out, is refused."""
    doc, figures = ACCEPTANCE, FIGURES
    assert acceptance_rec.Acceptance.model_validate(doc).by_proposal["argmax"].tau == 2.5
    with pytest.raises(ValidationError, match="surprise"):
        acceptance_rec.Acceptance.model_validate({**doc, "surprise": 1})
    with pytest.raises(ValidationError, match="by_proposal.argmax.speedup"):
        acceptance_rec.Acceptance.model_validate({**doc, "by_proposal": {"argmax": {**figures, "speedup": "2"}}})


# ---- the compile record (results/compile/<device>.json; tests/stages/test_record_writers.py runs its writer) -------
PART = {"device": "cpu", "role": "drafter", "backend": "sdpa", "compiled": False,
        "shapes": [{"batch": 2, "length": 64, "seconds": 0.5}], "graphs": 0, "cache_hits": 0, "cache_misses": 0,
        "seconds": 0.5}
RECORD = {"device": "cpu", "graphs": 0, "cache_hits": 0, "cache_misses": 0, "seconds": 0.5, "per_role": [PART],
          "env_hash": "0" * 16, "cache_dir": "/r/compile/cache-0000000000000000"}


def test_compile_record_is_exactly_the_model():
    rec = compile_rec.CompileRecord.model_validate_json(json.dumps(RECORD))
    assert rec.per_role[0].shapes[0].length == 64 and rec.per_role[0].modules is None    # a drafter has no modules
    target = {**PART, "role": "target", "modules": 3, "compiled": True}
    del target["backend"]
    assert compile_rec.CompileRecord.model_validate({**RECORD, "per_role": [PART, target]}).per_role[1].modules == 3
    for bad, where in (({**RECORD, "surprise": 1}, "surprise"),
                       ({**RECORD, "per_role": [{**PART, "role": "replica"}]}, "per_role.0.role"),
                       ({**RECORD, "per_role": [{**PART, "shapes": [{"batch": 2, "length": "64", "seconds": 1.0}]}]},
                        "per_role.0.shapes.0.length"),
                       ({k: v for k, v in RECORD.items() if k != "cache_dir"}, "cache_dir")):
        with pytest.raises(ValidationError, match=re.escape(where)):
            compile_rec.CompileRecord.model_validate_json(json.dumps(bad))
    from dflash.stages import warmup                     # an existing --out is the stage's own by the core's keys
    assert warmup.OURS == tuple(compile_rec.CompileRecordCore.model_fields) == ("device", "env_hash")


# ---- regressions.json: written by the report, read by the gate ------------------------------------------------------
def _history(tmp_path):
    """Three runs, the last a regression (torch changed, a drafter at 40 GB, recompiles), and an unreadable summary."""
    runs = tmp_path / "runs"
    for s, tau in ((summary(1, 12.0), 1.866), (summary(2, 12.1), 1.866),
                   (summary(3, 3.9, env=with_pkg("torch", "2.13.0"), mems=(40.0, 72.0, 77.0), recompiles=2), 1.70)):
        write_run(runs, s, metrics=False, evaluation=acceptance(s, tau))
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text("{")
    return runs


def test_the_report_writes_exactly_the_regressions_model_and_the_gate_reads_it(tmp_path):
    out = tmp_path / "report"
    build(_history(tmp_path), out, settings())
    text = (out / "regressions.json").read_text()
    reg = regressions.Regressions.model_validate_json(text)
    doc = json.loads(text)
    assert set(doc) == set(regressions.Regressions.model_fields)
    assert set(doc["runs"][-1]) == set(regressions.RunVerdict.model_fields)
    last = reg.runs[-1]
    assert last.verdict == "regression" and last.regressed == ["throughput", "quality"]
    assert last.baseline.runs == [summary(1)["run_id"], summary(2)["run_id"]] and last.quality.baseline.tau == 1.866
    assert last.changed.environment[0].model_dump() == {"key": "torch", "old": "2.11.0", "new": "2.13.0"}
    assert {a.kind for a in last.anomalies} == {"recompiles", "memory_imbalance"}
    assert next(a for a in last.anomalies if a.kind == "memory_imbalance").device == "cuda:5"
    assert reg.placement.current.model_dump() == {"targets": 5, "drafters": 3} and reg.placement.colocated is False
    assert [s.file for s in reg.skipped] == [str(tmp_path / "runs" / "broken" / "summary.json")]
    # the gate's view: what it uses, typed
    core = read(out / "regressions.json", regressions.RegressionsCore, "rerun the report stage")
    latest = gate.latest_of(core, "demo")
    assert (latest.run_id, latest.verdict, latest.quality.verdict) == (summary(3)["run_id"], "regression", "regression")
    assert gate.regressed(latest) == ["throughput", "quality"] and latest.sentence == doc["runs"][-1]["sentence"]
    assert gate.latest_of(core, "other").run_id == summary(3)["run_id"]       # another run name: the newest record


def test_the_report_refuses_to_write_a_record_the_model_does_not_describe(tmp_path, monkeypatch):
    real, runs = regress.evaluate, _history(tmp_path)
    monkeypatch.setattr(regress, "evaluate", lambda runs, st: [{**r, "surprise": 1} for r in real(runs, st)])
    with pytest.raises(ValidationError, match=re.escape("runs.0.surprise")):
        build(runs, tmp_path / "report", settings())
    assert not (tmp_path / "report" / "regressions.json").exists()             # refused before anything is written
    monkeypatch.setattr(regress, "evaluate", lambda runs, st: [{**r, "verdict": "fine"} for r in real(runs, st)])
    with pytest.raises(ValidationError, match=re.escape("runs.0.verdict")):
        build(runs, tmp_path / "report", settings())


def test_the_gate_reads_through_the_model_and_names_the_file_and_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path}/results\nrun_name: demo\nreport:\n  fail_on_regression: true\n")
    path, out = tmp_path / "regressions.json", tmp_path / "gate.json"

    def gate_on(runs) -> int:
        path.write_text(json.dumps({"runs": runs, "later_key": 1}))
        return main(["gate", "--config", str(cfg), "--regressions", str(path), "--out", str(out)])

    run = {"run_id": "demo-1", "run_name": "demo", "verdict": "ok", "sentence": "Run demo-1: fine.",
           "regressed": [], "quality": {"verdict": "ok", "tau": 1.8}}
    assert gate_on([run, {**run, "run_id": "other-1", "run_name": "other", "regressed": ["throughput"]}]) == 0
    assert json.loads(out.read_text()) == {"run_id": "demo-1", "verdict": "ok", "quality_verdict": "ok",
                                           "regressed": [], "fail_on_regression": True, "passed": True}
    old = {k: v for k, v in run.items() if k not in ("regressed", "quality")}   # before quality was judged
    assert gate_on([{**old, "verdict": "regression"}]) == 3
    assert "dflash gate: regression: Run demo-1: fine. (throughput regressed;" in capsys.readouterr().err
    for runs, where, what in (([{k: v for k, v in run.items() if k != "verdict"}], "runs.0.verdict", "Field required"),
                              ([{**run, "regressed": "quality"}], "runs.0.regressed", "Input should be a valid list"),
                              ([run, {**run, "quality": {"verdict": 3}}], "runs.1.quality.verdict",
                               "Input should be a valid string")):
        assert gate_on(runs) == 1
        err = capsys.readouterr().err
        assert f"{path}: key '{where}': {what}; rerun the report stage" in err and "Traceback" not in err
    path.write_text("[]")
    assert main(["gate", "--config", str(cfg), "--regressions", str(path), "--out", str(out)]) == 1
    assert f"{path}: expected a JSON object; rerun the report stage" in capsys.readouterr().err
def test_acceptance_readers_take_files_of_every_age_through_the_core():
    """AcceptanceCore, what the report, export and the model card read: the writer's record reads through it; the
    older files the report's tests keep (only `tau`; `tau` per prompt set; no `by_proposal`) read with the values the
    readers took from them by key before it, the evaluation hash included."""
    core = acceptance_rec.AcceptanceCore
    assert set(core.model_fields) - {"run_id"} < set(acceptance_rec.Acceptance.model_fields)   # run_id: by hand only
    read = core.model_validate(ACCEPTANCE)
    assert (read.tau, read.by_proposal["argmax"].tau, read.lossless, read.model_extra["engines"]) == \
        (2.5, 2.5, True, {"argmax": ["vLLM"]})
    assert history.tau_of({"tau": 6.2}) == 6.2 and history.tau_of({"tau": {"gsm8k": 6.0, "mt-bench": 5}}) == 5.5
    assert history.tau_of({"tau": {"gsm8k": {"tau": 6.0}, "mt-bench": {"tau": None}}}) == 6.0
    assert history.tau_of({**ACCEPTANCE, "temperature": 0.7}) is None
    old = {"created_at": "2026-01-01T00:05:00+00:00", "temperature": 0, "block_size": 16, "max_new_tokens": 64,
           "num_prompts": 16, "dtype": "float32", "device": "cpu", "tau": 1.866, "sets": {"holdout": {"tau": 1.866}},
           "data_hash": "abc"}
    settings = {**{k: old[k] for k in history.EVAL_KEYS if k in old}, "data_hash": "abc", "prompt_sets": ["holdout"]}
    assert history.evaluation_settings(old) == settings and json.dumps(settings["temperature"]) == "0"
    assert history.eval_hash(old) == hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    sampled = {"temperature": 1.0, "tau": 1.4}                               # before by_proposal: sampled drafts
    assert history.proposal_taus(sampled) == (1.0, {"sample": 1.4})
    assert history.proposal_text({**sampled, "by_proposal": {"argmax": {"tau": 2.96}, "sample": {"tau": 1.16}}}) == \
        "T=1: argmax 2.960; sample 1.160"


def test_a_malformed_acceptance_file_is_named_by_its_key(tmp_path):
    """A number as text: the report skips the file naming the key (the run keeps no evaluation), export refuses it."""
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({**ACCEPTANCE, "tau": "2.5"}))
    summary = {"run_id": "t-1", "finished_at": "2025-12-31T00:00:00+00:00"}
    data, skipped = history.read_acceptance(path, summary)
    assert data is None and skipped == {"file": str(path), "reason": "key 'tau': Input should be a valid number, got "
                                                                     "'2.5'; no tau for run t-1 until evaluate writes "
                                                                     "it again"}
    with pytest.raises(UserError, match=re.escape(f"{path}: key 'tau': Input should be a valid number")):
        _acceptance(path)
    path.write_text(json.dumps(ACCEPTANCE))
    assert history.read_acceptance(path, summary) == (ACCEPTANCE, None) and _acceptance(path).drafter == "ckpt"


def test_the_one_door_writes_a_models_keys_in_its_order_and_reads_through_a_view(tmp_path):
    """records.write: the keys given, in the model's order (a defaulted key not given is left out, as the target-only
    `modules` of a drafter's warm-up part); records.read: the view's model, else one line naming file, key and remedy."""
    part = compile_rec.WarmupPart(device="cpu", role="drafter", backend="sdpa", compiled=False,
                                  shapes=[{"batch": 2, "length": 64, "seconds": 0.5}], graphs=0, cache_hits=0,
                                  cache_misses=0, seconds=0.5)
    path = write(tmp_path / "part.json", part)
    assert list(json.loads(path.read_text())) == ["device", "role", "backend", "compiled", "shapes", "graphs",
                                                  "cache_hits", "cache_misses", "seconds"]
    assert read(path, compile_rec.WarmupPart, "rerun it") == part
    path.write_text(path.read_text().replace('"graphs": 0', '"graphs": "0"'))
    why = f"{path}: key 'graphs': Input should be a valid integer; rerun it"
    with pytest.raises(UserError, match=re.escape(why)):
        read(path, compile_rec.WarmupPart, "rerun it")
