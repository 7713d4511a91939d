# Shared helpers for the rules: paths derived from the validated config, nothing else.
import json
import os

from snakemake.exceptions import WorkflowError

if len(workflow.overwrite_configfiles) > 1:
    raise WorkflowError("give one --configfile: the stages read that single YAML")
# relative to the working directory, so `snakemake --configfile config/x.yaml` and a profile that names the same
# file give the same input path (an absolute/relative difference would rerun every stage)
CONFIG_FILE = (os.path.relpath(workflow.overwrite_configfiles[0]) if workflow.overwrite_configfiles
               else "config/config.yaml")
RESULTS = config["results_dir"]
RUN = config["run_name"]
DATASET = config["dataset_name"]
ENV = "../../envs/dflash.yaml"


def section(name):
    """A config section as a stable string: a rule whose section changes reruns (params trigger)."""
    return json.dumps(config.get(name, {}), sort_keys=True)


ALL_TARGETS = [f"{RESULTS}/env/fingerprint.json"]


def device_slug(spec):
    """'cuda:3' / '3' -> 'cuda3'; 'cpu' -> 'cpu' (file names of results/compile/<device>.json)."""
    s = str(spec)
    return f"cuda{s}" if s.isdigit() else s.replace(":", "")


DRAFTER_DEVICES = sorted({device_slug(d) for d in config["train"]["drafters"]})
TRAIN_GPUS = len({device_slug(d) for d in config["train"]["targets"] + config["train"]["drafters"]} - {"cpu"})
TARGET_DIR = config["target"]["path"]
