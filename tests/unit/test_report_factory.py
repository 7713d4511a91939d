"""The report tests' factory of synthetic run summaries (tests/support/report_factory.py) gives valid ones."""
import json

from support.report_factory import summary, with_pkg


def test_factory_summary_is_valid(tmp_path):
    from dflash.report.history import validate_summary
    s = summary(1)
    assert validate_summary(json.loads(json.dumps(s)), tmp_path / "x") is not None
    assert summary(2, env=with_pkg("torch", "2.13.0"))["env_hash"] != s["env_hash"]
