# What the rules share: the config (read strictly, validated as the stages validate it, checked against this
# machine and the files it names), the paths of dflash/paths.py, the interpreter, and what reruns each rule: the config
# keys whose role (dflash/config_model.py) names the rule and the content of the files the config names for it, held
# by the rule's key stamp (dflash/stamps.py), an input that moves only when they change.
import contextlib
import io
import json
import os
import platform
import re

from snakemake.exceptions import WorkflowError

from dflash import fingerprint, inputs, paths, stamps, sweep
from dflash.config import ConfigError, check_here, configfile_flags, for_workflow, trigger
from dflash.errors import UserError
from dflash.stages.target import check_out as check_target_out
from dflash.target import target_problem

# Several YAMLs are refused, never silently dropped: `--configfile a b` reaches the workflow as two files, while
# `--configfile a --configfile b` reaches it as b alone (argparse keeps the last flag), so the command line is read too.
_given = configfile_flags(sys.argv[1:])
if len(workflow.overwrite_configfiles) > 1 or len(_given) > 1:
    _many = workflow.overwrite_configfiles if len(workflow.overwrite_configfiles) > 1 else _given
    _files = " ".join(os.path.relpath(f) for f in _many)
    raise WorkflowError(f"give one --configfile (got {_files}): the stages read that single YAML, so several are not "
                        "merged; put the keys in one file, or give the differences as --config KEY=VALUE")
# The stages read this file themselves (plus --config values as --set). It is neither an input nor a param:
# a copy with the same content reruns nothing; a changed key reruns the rules its role names (rerun_by).
CONFIG_FILE = (os.path.relpath(workflow.overwrite_configfiles[0]) if workflow.overwrite_configfiles
               else "config/config.yaml")


def _cli():
    """Snakemake's command line (with its profiles) as Snakemake reads it; None where it cannot be read (the API)."""
    from snakemake.cli import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return parse_args(sys.argv[1:])[1]
    except (Exception, SystemExit):
        return None


_CLI = None if workflow.remote_exec else _cli()


def _jobs_run_here() -> bool:
    """Whether this machine runs the jobs: not when a cluster executor (slurm, ...) submits them from here, whose jobs
    read this Snakefile again on their nodes (remote mode), where the machine is checked. A command line Snakemake
    cannot read counts as local."""
    return workflow.remote_exec or _CLI is None or _CLI.executor in (None, "local", "dryrun", "touch")


try:
    _loaded, _sets = for_workflow(CONFIG_FILE, workflow.config_settings.config)
except ConfigError as e:
    raise WorkflowError(f"config error: {e}") from None
_MODE = stamps.mode_of(_CLI, workflow.remote_exec)
try:
    check_here(_loaded, devices=False)  # a target layer past the layers of the target folder
    try:
        check_here(_loaded)  # a CUDA device this machine lacks (a cluster executor's jobs run elsewhere)
    except ConfigError as e:  # a dry run, --lint, ... only read the workflow: the jobs run on the machine that has them
        if _jobs_run_here() and (_MODE == "run" or workflow.remote_exec):
            raise
        if _MODE == "plan":
            print(f"note: {e}; planned only: a run on this machine is refused", file=sys.stderr)
    inputs.check(_loaded.cfg, _loaded.source)  # a file or folder the config names that is not there
    SWEEP = sweep.expand(_loaded)  # the runs: the config's own, and its sweep's (dflash/sweep.py)
except ConfigError as e:
    raise WorkflowError(f"config error: {e}") from None
CFG = _loaded.cfg  # the typed config (defaults are the models'); `config` is the same as a plain dict
config.clear()
config.update(_loaded.raw)

# Rules call `python`: the interpreter Snakemake runs in (its folder first on PATH, inherited by every job), or
# under --sdm conda the rule's environment (activated inside the job, so it comes first).
envvars:
    "PATH",


_inherited = os.environ["PATH"]
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), _inherited])


def config_args(wildcards, input):
    """How a stage reads the config: the file, the --config values as --set, and for a sweep's run (or dataset) its
    overrides as --set. Declared as a function of the input, so it is no rerun trigger: what triggers a rule is its
    `config` param (the sections it depends on)."""
    run, dataset = getattr(wildcards, "run", None), getattr(wildcards, "dataset", None)
    own = SWEEP.runs[run].sets if run else SWEEP.sets[dataset] if dataset else []
    return ["--config", CONFIG_FILE] + [a for s in [*_sets, *own] for a in ("--set", s)]


ENV = "../../envs/dflash.yaml"

RESULTS = CFG.results_dir
RUN = CFG.run_name  # the config's own run: exported and reported; a sweep adds its runs (RUNS)
DATASET = CFG.dataset_name
RUNS = list(SWEEP.runs)
DATASETS = list(SWEEP.datasets)
DECODED = [r for r in RUNS if SWEEP.runs[r].decoded]


RUN_FOLDER = paths.RunFolder   # a run folder's layout: its file names (RUN_FOLDER.SUMMARY, ...)


def run_file(run, name):
    """A file of a run's folder: results/runs/<run>/<name> (run may be the wildcard "{run}"; name: RUN_FOLDER's)."""
    return str(paths.run(RESULTS, run) / name)


def manifest(dataset):
    return str(paths.dataset(RESULTS, dataset) / "manifest.json")


def holdout(dataset):
    return str(paths.dataset(RESULTS, dataset) / "holdout.jsonl")


def data_of(wildcards):
    """The manifest of the dataset a run trains on."""
    return manifest(SWEEP.runs[wildcards.run].dataset)


def evaluations(run):
    """The evaluate stage's outputs of a run: acceptance.json and one per other temperature (none when the sweep
    takes its tau from its training, sweep.evaluate own)."""
    r, folder = SWEEP.runs[run], RUN_FOLDER(paths.run(RESULTS, run))
    return [str(folder.acceptance())] * r.decoded + [str(folder.acceptance(t)) for t in r.temperatures]
TARGET_DIR = CFG.target.path
# the target folder the target rule builds (its output, so a rebuild reruns what reads it); with build none the folder
# is the user's, an input each rule that reads it names (reads) and its stamp holds by content
TARGET_BUILT = [TARGET_DIR] if CFG.target.build != "none" else []
LOGS = paths.logs(RESULTS)
BENCH = paths.benchmarks(RESULTS)
# warm-up jobs: every device running a drafter replica and, with train.compile_target, every device running a target
WARMUP_DEVICES = sorted({paths.device_slug(d) for d in CFG.train.drafters
                         + (CFG.train.targets if CFG.train.compile_target else ())})
TRAIN_GPUS = len({paths.device_slug(d) for d in CFG.train.targets + CFG.train.drafters} - {"cpu"})


def forced(rule, outputs) -> bool:
    """Whether the command line forces this rule itself (-R RULE or one of its outputs, --forceall, -f on its
    output): not merely a rerun Snakemake decides (a newer input, a changed param, an incomplete marker). While the
    workflow is read, before Snakemake has its DAG settings, from its command line."""
    ds, cli = workflow.dag_settings, _CLI
    run, every, on_targets, targets = ((ds.forcerun, ds.forceall, ds.forcetargets, ds.targets) if ds is not None else
                                       (cli.forcerun, cli.forceall, cli.force, cli.targets) if cli is not None else
                                       ((), False, False, ()))
    asked = {str(x) for x in run or ()} | ({str(x) for x in targets or ()} if on_targets else set())
    return bool(every) or rule in asked or any(str(o) in asked for o in outputs)


def rerun_by(rule):
    """The rule's rerun trigger (its `config` param): the config keys whose role names it, as one stable string. Its
    key stamp holds them too, so that they rerun it when Snakemake's metadata is gone. For a rule of a sweep's runs
    (or datasets) a function of the wildcard: each run's (dataset's) own keys."""
    per = {"train": "run", "evaluate": "run", "export": "run", "data": "dataset"}.get(rule)
    if per is None:
        return trigger(config, rule)
    of = (lambda w: SWEEP.runs[w.run].loaded) if per == "run" else (lambda w: SWEEP.datasets[w.dataset])
    return lambda wildcards: trigger(of(wildcards).raw, rule)


STAMPS = stamps.Stamps(RESULTS, CFG, config, _MODE)


def stamp(rule, name="", files=(), extra=None, loaded=None):
    """The rule's key stamp (an input): the hash of its config keys and of the content of the files the config names
    for it (and of `files`, `extra`), for the output named `name`; rewritten only when that hash changes. `loaded`: a
    sweep run's (dataset's) config."""
    try:
        return STAMPS.path(rule, name, files, extra, loaded)
    except (UserError, OSError) as e:  # a named file that cannot be read, a stamps folder that cannot be written
        raise WorkflowError(f"{rule}'s key stamp: {e}") from None


def run_stamp(rule):
    """The key stamp of `rule` for each run of the sweep (its own config), made now; an input function of {run}."""
    made = {r: stamp(rule, r, loaded=SWEEP.runs[r].loaded) for r in RUNS}
    return lambda wildcards: made[wildcards.run]


def data_stamp():
    """The data rule's key stamp for each dataset of the sweep; an input function of {dataset}."""
    made = {d: stamp("data", d, loaded=loaded) for d, loaded in SWEEP.datasets.items()}
    return lambda wildcards: made[wildcards.dataset]


def reads(rule):
    """The files and folders the config names for this rule to read, as inputs that must exist. Their content is
    in its stamp, so their mtimes are not what reruns it (ancient)."""
    return [ancient(n.path) for n in inputs.named(CFG, rule)]


def env_key():
    """What the environment fingerprint hashes, read without importing torch: a change reruns env onward."""
    return json.dumps({"python": platform.python_version(), "gpu": fingerprint.gpu_info(),
                       "packages": {p: fingerprint.package_version(p) for p in fingerprint.PACKAGES}}, sort_keys=True)
