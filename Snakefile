# dflash: train DFlash speculative-decoding drafters and keep their throughput honest.
# Thin orchestration only: every rule calls `python -m dflash <stage>`; the logic lives in the dflash package.
from snakemake.utils import min_version, validate

min_version("9.0")


# The embedded default, unless --configfile names another: one YAML, never a merge of two (the stages read the
# same single file, so a key of the default can never leak into another config).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/env.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/warmup.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


rule all:
    input:
        ALL_TARGETS,
    default_target: True
