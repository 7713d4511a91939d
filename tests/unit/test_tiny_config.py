"""config/tiny.yaml, the smallest whole-pipeline run (tests/e2e/test_workflow.py runs it): a valid config of the
tests' tiny target, small everywhere."""
from dflash import config as C
from support.data import TINY_ARCH
from support.workflow import REPO


def test_tiny_config_is_valid_and_the_tests_tiny_target():
    cfg = C.load(REPO / "config" / "tiny.yaml").cfg
    assert cfg.target.build == "tiny" and {k: getattr(cfg.target.arch, k) for k in TINY_ARCH} == TINY_ARCH
    small = (cfg.train.steps, cfg.train.compile, cfg.evaluate.num_prompts, cfg.data.regenerate.enabled)
    assert small == (3, False, 2, False)
