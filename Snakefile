# dflash: train DFlash speculative-decoding drafters and keep their throughput honest.
# Thin orchestration only: every rule calls `python -m dflash <stage>` with the paths of its inputs and outputs;
# the logic lives in the dflash package.
import re
import sys

from snakemake.utils import min_version

min_version("9.0")
sys.path.insert(0, workflow.basedir)  # this checkout's dflash package (config, paths), whatever the interpreter


include: "workflow/rules/common.smk"


# the runs (the config's own and its sweep's), their datasets and the other temperatures a run is evaluated at
wildcard_constraints:
    run="|".join(map(re.escape, RUNS)),
    dataset="|".join(map(re.escape, DATASETS)),
    temp=r"[0-9]+(\.[0-9]+)?",


include: "workflow/rules/env.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/warmup.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


# Every run of the config (its own, and its sweep's: dflash/sweep.py) trained and evaluated; the config's own run
# exported and reported; the sweep's table when it declares one.
rule all:
    input:
        rules.env.output,
        [manifest(d) for d in DATASETS],
        [run_file(r, RUN_FOLDER.SUMMARY) for r in RUNS],
        [e for r in RUNS for e in evaluations(r)],
        run_file(RUN, RUN_FOLDER.DRAFTER),
        rules.report.output,
        rules.gate.output,
        rules.sweep_table.output if SWEEP.declared else [],
    default_target: True
