# Stage 'evaluate': speculative decoding of held-out prompts with the target and the checkpoint the run ended with;
# writes acceptance.json (tau, its distribution, tokens/s, losslessness).
rule evaluate:
    input:
        summary=rules.train.output.summary,
        target=TARGET_BUILT,
        named=reads("evaluate"),
        stamp=stamp("evaluate", RUN),
        data=rules.data.output.manifest,
        holdout=rules.data.output.holdout,  # hashed in the manifest; a changed file reruns evaluate, which refuses it
    output:
        paths.run(RESULTS, RUN) / "acceptance.json",
    params:
        stage_config=config_args,
        run_dir=lambda wildcards, input: os.path.dirname(input.summary),
        config=rerun_by("evaluate"),
    log:
        LOGS / "evaluate" / f"{RUN}.log",
    benchmark:
        BENCH / "evaluate" / f"{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash evaluate {params.stage_config:q} --run-dir {params.run_dir:q} --holdout {input.holdout:q}"
        " --same-config --out {output:q} --log {log:q}"
