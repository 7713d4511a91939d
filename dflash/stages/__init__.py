"""One module per pipeline stage: `add_arguments(parser)` and `run(loaded, args) -> int`.

Stage modules stay thin and import the heavy machinery (torch, transformers) inside `run`, so that
`python -m dflash --help` is instant.
"""


def check_run_config(loaded, run_dir) -> None:
    """Refuse a run folder trained with another config, e.g. by hand with `--set train.steps=50`: its drafter must
    not be evaluated, exported or reported as this config's run. Keys that do not change training (names,
    report and evaluate settings) are not part of the config hash and never refuse."""
    import json
    from pathlib import Path

    from dflash.errors import UserError

    path = Path(run_dir, "summary.json")
    try:
        made = json.loads(path.read_text()).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return  # no summary: the stage reports what it misses itself
    if made and made != loaded.hash:
        raise UserError(f"{path} was trained with another config (config hash {made}; this config: {loaded.hash}), "
                        "e.g. a run made by hand with --set: retrain it (snakemake -R train), or give a run by hand "
                        "its own name (--set run_name=NAME)")
