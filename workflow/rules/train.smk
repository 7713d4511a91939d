# Stage 'train': the threads runtime in one process, or (runtime distributed) one process per device under
# torchrun, launched by the stage itself.
rule train:
    input:
        env=rules.env.output[0],
        data=rules.data.output.manifest,
        target=TARGET_BUILT,
        named=reads("train"),
        stamp=stamp("train", RUN),
        warmup=expand(rules.warmup.output[0], device=WARMUP_DEVICES),
    output:
        summary=paths.run(RESULTS, RUN) / "summary.json",
        metrics=paths.run(RESULTS, RUN) / "metrics.jsonl",
    params:
        # a finished run is restored, not retrained, unless train itself is forced (a function of the input: no trigger)
        stage_config=lambda wildcards, input: config_args(wildcards, input)
        + (["--retrain"] if forced("train", rules.train.output) else []),
        data=lambda wildcards, input: os.path.dirname(input.data),
        run_dir=lambda wildcards, output: os.path.dirname(output.summary),
        config=rerun_by("train"),
    resources:
        gpu=TRAIN_GPUS,
    log:
        LOGS / "train" / f"{RUN}.log",
    benchmark:
        BENCH / "train" / f"{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash train {params.stage_config:q} --data {params.data:q} --run-dir {params.run_dir:q} --log {log:q}"
