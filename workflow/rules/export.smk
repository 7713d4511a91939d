# Stage 'export': the trained drafter in the reference inference format (+ README.md model card): the config's own
# run's (a sweep's other runs are experiments; `snakemake results/runs/<run>/drafter` exports one of them).
from dflash.stages.export import check_out as check_export_out

# Snakemake removes a directory() output before its job: a drafter folder holding files the export did not write
# (a user's) is refused now, naming them, instead of being removed without a word.
try:
    for _run in RUNS:
        check_export_out(RUN_FOLDER(paths.run(RESULTS, _run)).drafter)
except (ConfigError, UserError) as e:
    raise WorkflowError(str(e)) from None


rule export:
    input:
        summary=run_file("{run}", RUN_FOLDER.SUMMARY),
        acceptance=run_file("{run}", RUN_FOLDER.ACCEPTANCE),  # the model card states tau
        data=data_of,
        target=TARGET_BUILT,
        named=reads("export"),
        stamp=run_stamp("export"),
    output:
        directory(run_file("{run}", RUN_FOLDER.DRAFTER)),
    params:
        stage_config=config_args,
        run_dir=lambda wildcards, input: os.path.dirname(input.summary),
        data=lambda wildcards, input: os.path.dirname(input.data),
        config=rerun_by("export"),
    log:
        LOGS / "export" / "{run}.log",
    benchmark:
        BENCH / "export" / "{run}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash export {params.stage_config:q} --run-dir {params.run_dir:q} --data {params.data:q} --same-config"
        " --out {output:q} --log {log:q}"
