# Stage 'export': the trained drafter in the reference inference format (+ README.md model card).
from dflash.stages.export import check_out as check_export_out

# Snakemake removes a directory() output before its job: a drafter folder holding files the export did not write
# (a user's) is refused now, naming them, instead of being removed without a word.
try:
    check_export_out(paths.run(RESULTS, RUN) / "drafter")
except (ConfigError, UserError) as e:
    raise WorkflowError(str(e)) from None


rule export:
    input:
        summary=rules.train.output.summary,
        acceptance=rules.evaluate.output[0],  # the model card states tau
        data=rules.data.output.manifest,
        target=TARGET_BUILT,
        named=reads("export"),
        stamp=stamp("export", RUN),
    output:
        directory(paths.run(RESULTS, RUN) / "drafter"),
    params:
        stage_config=config_args,
        run_dir=lambda wildcards, input: os.path.dirname(input.summary),
        data=lambda wildcards, input: os.path.dirname(input.data),
        config=rerun_by("export"),
    log:
        LOGS / "export" / f"{RUN}.log",
    benchmark:
        BENCH / "export" / f"{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash export {params.stage_config:q} --run-dir {params.run_dir:q} --data {params.data:q} --same-config"
        " --out {output:q} --log {log:q}"
