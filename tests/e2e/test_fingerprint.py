import json

from dflash import fingerprint


def test_hash_stable_across_calls():
    a, b = fingerprint.collect(), fingerprint.collect()
    assert a["hash"] == b["hash"]
    assert len(a["hash"]) == 16


def test_hash_changes_with_a_version(monkeypatch):
    before = fingerprint.collect()
    real = fingerprint.package_version

    def patched(name):
        return "9.9.9" if name == "transformers" else real(name)

    monkeypatch.setattr(fingerprint, "package_version", patched)
    after = fingerprint.collect()
    assert after["packages"]["transformers"] == "9.9.9"
    assert after["hash"] != before["hash"]


def test_pin_mismatch_listed(tmp_path):
    fp = fingerprint.collect()
    pins = {"torch": "0.0.1", "transformers": fp["packages"]["transformers"]}
    problems = fingerprint.pin_mismatches(fp, pins)
    assert problems == [f"torch: pinned 0.0.1, found {fp['packages']['torch']}"]


def test_env_stage_writes_fingerprint_and_strict_fails(tmp_path, monkeypatch, capsys):
    """The env stage through the CLI, in process (no launch): it writes the fingerprint; strict_env with a pin that
    cannot match fails naming it."""
    from dflash.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path}/results\n")
    assert main(["env", "--config", str(cfg)]) == 0, capsys.readouterr().err
    fp = json.loads((tmp_path / "results/env/fingerprint.json").read_text())
    for key in ("python", "packages", "cuda", "cudnn", "gpu", "cpu", "hash"):
        assert key in fp
    # strict mode with a pin that cannot match
    pins = tmp_path / "pins.txt"
    pins.write_text("torch==0.0.1\n")
    monkeypatch.setattr(fingerprint, "PINS", pins)
    capsys.readouterr()
    assert main(["env", "--config", str(cfg), "--set", "strict_env=true"]) == 1
    assert "torch: pinned 0.0.1" in capsys.readouterr().err
