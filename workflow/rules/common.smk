# What the rules share: the config (read strictly, validated as the stages validate it), the paths of
# dflash/paths.py, the interpreter, and the per-rule config sections that are the rules' rerun triggers.
import json
import os
import platform

from snakemake.exceptions import WorkflowError

from dflash import fingerprint, paths
from dflash.config import ConfigError, configfile_flags, for_workflow
from dflash.errors import UserError
from dflash.stages.target import check_out as check_target_out

# Several YAMLs are refused, never silently dropped: `--configfile a b` reaches the workflow as two files, while
# `--configfile a --configfile b` reaches it as b alone (argparse keeps the last flag), so the command line is read too.
_given = configfile_flags(sys.argv[1:])
if len(workflow.overwrite_configfiles) > 1 or len(_given) > 1:
    _many = workflow.overwrite_configfiles if len(workflow.overwrite_configfiles) > 1 else _given
    _files = " ".join(os.path.relpath(f) for f in _many)
    raise WorkflowError(f"give one --configfile (got {_files}): the stages read that single YAML, so several are not "
                        "merged; put the keys in one file, or give the differences as --config KEY=VALUE")
# The stages read this file themselves (plus --config values as --set). It is neither an input nor a param:
# a copy with the same content reruns nothing; a changed key reruns the rules whose params hold its section.
CONFIG_FILE = (os.path.relpath(workflow.overwrite_configfiles[0]) if workflow.overwrite_configfiles
               else "config/config.yaml")
try:
    _resolved, _sets = for_workflow(CONFIG_FILE, workflow.config_settings.config)
except ConfigError as e:
    raise WorkflowError(f"config error: {e}") from None
config.clear()
config.update(_resolved)

# Rules call `python`: the interpreter Snakemake runs in (its folder first on PATH, inherited by every job), or
# under --sdm conda the rule's environment (activated inside the job, so it comes first).
envvars:
    "PATH",


_inherited = os.environ["PATH"]
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), _inherited])


def config_args(wildcards, input):
    """How a stage reads the config: the file and the --config values as --set. Declared as a function of the
    input, so it is no rerun trigger: what triggers a rule is its `config` param (the sections it depends on)."""
    return ["--config", CONFIG_FILE] + [a for s in _sets for a in ("--set", s)]


ENV = "../../envs/dflash.yaml"

RESULTS = config["results_dir"]
RUN = config["run_name"]
DATASET = config["dataset_name"]
TARGET_DIR = config["target"]["path"]
LOGS = paths.logs(RESULTS)
BENCH = paths.benchmarks(RESULTS)
# warm-up jobs: every device running a drafter replica and, with train.compile_target, every device running a target
WARMUP_DEVICES = sorted({paths.device_slug(d) for d in config["train"]["drafters"]
                         + (config["train"]["targets"] if config["train"]["compile_target"] else [])})
TRAIN_GPUS = len({paths.device_slug(d) for d in config["train"]["targets"] + config["train"]["drafters"]} - {"cpu"})


def forced(rule, outputs) -> bool:
    """Whether the command line forces this rule itself (-R RULE or one of its outputs, --forceall, -f on its
    output): not merely a rerun Snakemake decides (a newer input, a changed param, an incomplete marker)."""
    ds = workflow.dag_settings
    asked = {str(x) for x in ds.forcerun} | ({str(x) for x in ds.targets} if ds.forcetargets else set())
    return ds.forceall or rule in asked or any(str(o) in asked for o in outputs)


def section(*keys):
    """Config sections as one stable string (sorted keys): a rule whose sections change reruns (params)."""
    return json.dumps({k: config[k] for k in keys}, sort_keys=True)


# train keys that shape no compiled graph (optimiser, schedule, logging, supervision, the runtime that carries the
# same compiled drafter, the loss weighting: applied after the compiled loss kernel): a change reruns train onward,
# not the warm-up (train.objective changes the features' width and the loss kernel: it reruns the warm-up)
TRAIN_ONLY = ("steps", "runtime", "optimizer", "lr", "muon_lr", "betas", "weight_decay", "warmup_ratio",
              "min_lr_ratio", "time_budget_s", "grad_clip", "grad_accum", "checkpoint_every", "log_every", "resume",
              "warmup_steps_excluded", "matmul_tflops", "ready_timeout_s", "stall_timeout_s", "fail_at_step",
              "queue_size", "rendezvous", "check_every", "diverge_at_step", "stop_timeout_s", "profile",
              "loss_weighting", "dpace_alpha", "eval_every", "eval_prompts", "eval_max_new_tokens")


def warmup_section():
    train = {k: v for k, v in config["train"].items() if k not in TRAIN_ONLY}
    return json.dumps({"train": train, **{k: config[k] for k in ("drafter", "target", "seed")}}, sort_keys=True)


def env_key():
    """What the environment fingerprint hashes, read without importing torch: a change reruns env onward."""
    return json.dumps({"python": platform.python_version(), "gpu": fingerprint.gpu_info(),
                       "packages": {p: fingerprint.package_version(p) for p in fingerprint.PACKAGES}}, sort_keys=True)
