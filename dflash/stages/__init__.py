"""One module per pipeline stage: `add_arguments(parser)` and `run(loaded, args) -> int`.

Stage modules stay thin and import the heavy machinery (torch, transformers) inside `run`, so that
`python -m dflash --help` is instant.
"""
from dflash.config import Loaded, result_hash


def check_run_config(loaded: Loaded, run_dir) -> None:
    """Refuse a run folder trained with another config, e.g. by hand with `--set train.steps=50`: its drafter must
    not be evaluated, exported or reported as this config's run. Only keys that change the trained drafter count
    (dflash.config.result_hash): names, report and evaluate settings and the operational train keys never refuse
    (a finished run restored under a new train.log_every is the same run)."""
    import json

    from dflash.errors import UserError
    from dflash.paths import RunFolder

    path = RunFolder(run_dir).summary
    try:
        summary = json.loads(path.read_text())
        made, want = ((result_hash(summary["config"]), loaded.result_hash) if isinstance(summary.get("config"), dict)
                      else (summary.get("config_hash"), loaded.hash))    # a summary without its config: every key
    except (OSError, ValueError, AttributeError):
        return  # no summary: the stage reports what it misses itself
    if made and made != want:
        raise UserError(f"{path} was trained with another config (hash {made}; this config: {want}), e.g. a run "
                        "made by hand with --set: retrain it (snakemake -R train), or give a run by hand its own name "
                        "(--set run_name=NAME)")
