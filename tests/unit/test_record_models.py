"""The typed models of the files that cross a stage (issue 41 item 2): the docs' tables are generated from them, the
writer's record is exactly the model, the readers' views take what they need and keep the rest."""
import hashlib
import json
import re

import pytest
from pydantic import ValidationError

from dflash import acceptance_model
from dflash.data import manifest, shards
from dflash.errors import UserError
from dflash.report import history
from dflash.stages.export import _acceptance
from dflash.train import checkpoint_records


@pytest.mark.parametrize("name, table, keys", [
    ("manifest-keys", manifest.key_table, ("content_hash", "manifest_hash", "sources.<name>.rejected",
                                           "regeneration.tokens_per_s", "tokenizer.mask_token_id")),
    ("acceptance-keys", acceptance_model.key_table, ("tau", "by_proposal", "sets.<name>.tau_prompt_mean",
                                                     "sets.<name>.plain.target_forwards", "stop_token_ids")),
    ("trainer-keys", checkpoint_records.trainer_key_table, ("step", "data_index", "scheduler", "python_random",
                                                            "result_hash", "metrics", "finished_by")),
    ("finished-keys", checkpoint_records.finished_key_table, ("outputs", "checkpoint.path", "checkpoint.manifest")),
])
def test_docs_list_the_keys_of_the_model(repo, name, table, keys):
    text = (repo / "docs" / "architecture.md").read_text()
    block = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert block and block.group(1) == table(), f"docs/architecture.md: paste {table.__module__}.{table.__name__}()"
    for key in keys:
        assert f"| `{key}` |" in block.group(1)


def test_manifest_writer_refuses_a_key_the_model_does_not_describe(tmp_path):
    with pytest.raises(ValidationError, match="dataset"):          # a partial record: the keys it lacks are named
        shards.write_manifest(tmp_path, {"content_hash": "0" * 16}, manifest.Manifest)
    assert not (tmp_path / shards.MANIFEST).exists()               # refused before anything is written
    fields = {k: f for k, f in manifest.Manifest.model_fields.items() if f.is_required()}
    assert {"files", "manifest_hash", "dataset", "sources", "tokenizer", "created_at"} <= set(fields)


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
    assert acceptance_model.Acceptance.model_validate(doc).by_proposal["argmax"].tau == 2.5
    with pytest.raises(ValidationError, match="surprise"):
        acceptance_model.Acceptance.model_validate({**doc, "surprise": 1})
    with pytest.raises(ValidationError, match="by_proposal.argmax.speedup"):
        acceptance_model.Acceptance.model_validate({**doc, "by_proposal": {"argmax": {**figures, "speedup": "2"}}})


def test_acceptance_readers_take_files_of_every_age_through_the_core():
    """AcceptanceCore, what the report, export and the model card read: the writer's record reads through it; the
    older files the report's tests keep (only `tau`; `tau` per prompt set; no `by_proposal`) read with the values the
    readers took from them by key before it, the evaluation hash included."""
    core = acceptance_model.AcceptanceCore
    assert set(core.model_fields) - {"run_id"} < set(acceptance_model.Acceptance.model_fields)   # run_id: by hand only
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
