# Stage 'export': the trained drafter in the reference inference format (+ README.md model card).
rule export:
    input:
        summary=rules.train.output.summary,
        acceptance=rules.evaluate.output[0],  # the model card states tau
        data=rules.data.output.manifest,
        target=TARGET_DIR,
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
