"""summary.json's one typed description (dflash/records/summary.py): the docs' table is generated from it, the report's
reader takes what it needs from it, the writer's record is exactly it (tests/e2e/test_train.py validates a real one)."""
import copy
import re

import pytest

from dflash.report.history import BadSummary, validate_summary
from dflash.records.summary import RunSummary, SummaryCore, key_table


def test_docs_list_the_keys_of_the_model(repo):
    text = (repo / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- summary-keys:begin -->\n(.*?)<!-- summary-keys:end -->", text, re.S)
    assert block and block.group(1) == key_table(), "docs/architecture.md: paste dflash.records.summary.key_table()"
    for key in ("config_hash", "throughput.ktok_per_s", "throughput.mfu_drafter", "checkpoint.manifest", "finished_by"):
        assert f"| `{key}` |" in block.group(1)


CORE = {"run_id": "demo-1", "started_at": "2026-01-01T00:00:00+00:00", "status": "completed",
        "git": {"commit": None}, "config_hash": "0" * 16, "config": {}, "env_hash": "1" * 16, "env": {},
        "data_hash": None, "data": {}, "throughput": {"ktok_per_s": None}}


def test_reader_needs_the_core_keys_and_keeps_the_rest(tmp_path):
    data = {**CORE, "loss": 1.5, "throughput": {"ktok_per_s": 12, "later_key": 1}}
    assert validate_summary(data, tmp_path / "s.json") is data                 # other keys, old or new, pass through
    assert set(SummaryCore.model_fields) < set(RunSummary.model_fields)
    for broken, message in ((lambda d: d.pop("throughput"), "missing key 'throughput'"),
                            (lambda d: d["git"].pop("commit"), "missing key 'git.commit'"),
                            (lambda d: d["throughput"].update(ktok_per_s="12"), "key 'throughput.ktok_per_s'"),
                            (lambda d: d.update(status=3), "key 'status'"),
                            (lambda d: d.update(run_id=" "), "key 'run_id' is empty")):
        data = copy.deepcopy(CORE)
        broken(data)
        with pytest.raises(BadSummary, match=re.escape(f"s.json: {message}")):
            validate_summary(data, tmp_path / "s.json")


def test_writer_record_is_exactly_the_model():
    """A key the model does not describe, or one it describes left out, fails the writer's check."""
    fields = {k: None for k in RunSummary.model_fields}
    with pytest.raises(Exception, match="extra"):
        RunSummary.model_validate({**CORE, **fields, "surprise": 1})
    with pytest.raises(Exception, match="check_every"):
        RunSummary.model_validate({k: v for k, v in {**fields, **CORE}.items() if k != "check_every"})
