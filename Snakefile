# dflash: train DFlash speculative-decoding drafters and keep their throughput honest.
# Thin orchestration only: every rule calls `python -m dflash <stage>` with the paths of its inputs and outputs;
# the logic lives in the dflash package.
import sys

from snakemake.utils import min_version

min_version("9.0")
sys.path.insert(0, workflow.basedir)  # this checkout's dflash package (config, paths), whatever the interpreter


include: "workflow/rules/common.smk"
include: "workflow/rules/env.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/warmup.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


rule all:
    input:
        rules.env.output,
        rules.data.output,
        rules.train.output,
        rules.evaluate.output,
        rules.export.output,
        rules.report.output,
        rules.gate.output,
    default_target: True
