"""Issue 47 item 6 where a user meets it first: `snakemake -n` on a copy of the repository. Numbers in scientific
notation are numbers in a config, its `base:` and `--config`; an error inside a `base:` file names that file; a run
name too long for the report's files is refused before any job. The stages' side: tests/stages/test_faults_words.py.
Each test failed on eb0a841."""
import pytest

from support.workflow import SNAKEMAKE, copy_repo, snakemake

pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment")


@pytest.fixture(scope="module")
def wf(tmp_path_factory):
    work = copy_repo(tmp_path_factory.mktemp("words") / "wf")
    (work / "config" / "common.yaml").write_text("base: config.yaml\ntrain: {lr: 1e-4, weight_decay: 1E-2}\n")
    (work / "config" / "mine.yaml").write_text("base: common.yaml\nrun_name: mine\n")
    return work


def message(r) -> list[str]:
    return [line for line in r.out.splitlines() if "config error" in line]


def test_scientific_notation_plans_and_reaches_the_stages_as_numbers(wf):
    r = snakemake(wf, "-n", "-p", "--configfile", "config/mine.yaml", "--config", "train={warmup_ratio: 5e-2}")
    assert r.returncode == 0, r.out[-3000:]
    assert "--set train.warmup_ratio=0.05" in r.out, r.out[-3000:]


def test_an_error_in_a_base_file_names_that_file(wf):
    (wf / "config" / "typo.yaml").write_text("base: config.yaml\ntrain: {stepz: 3}\n")
    (wf / "config" / "top.yaml").write_text("base: typo.yaml\nrun_name: top\n")
    r = snakemake(wf, "-n", "--configfile", "config/top.yaml")
    assert r.returncode != 0 and len(message(r)) == 1, r.out[-3000:]
    assert message(r)[0].startswith("config error: config/typo.yaml (a base of config/top.yaml): unknown key "
                                    "'train.stepz'"), r.out[-3000:]


def test_a_run_name_too_long_for_its_files_is_refused_before_any_job(wf):
    """240 characters trained, then the report died writing history/<run_id>.json (255 bytes a name)."""
    r = snakemake(wf, "-n", "--config", f"run_name={'r' * 240}")
    assert r.returncode != 0 and len(message(r)) == 1, r.out[-3000:]
    assert "config error: config/config.yaml: key 'run_name' must be at most 128 characters" in r.out, r.out[-3000:]
