# Stage 'train': one job per run (the config's own and each of its sweep's, results/runs/{run}/), on the dataset of
# the run's data keys. The threads runtime in one process, or (runtime distributed) one process per device under
# torchrun, launched by the stage itself. A run cut short resumes from its checkpoint when its job runs again.
rule train:
    input:
        env=paths.fingerprint(RESULTS),
        data=data_of,
        target=TARGET_BUILT,
        named=reads("train"),
        stamp=run_stamp("train"),
        warmup=expand(paths.compile_record(RESULTS, "{device}"), device=WARMUP_DEVICES),
    output:
        summary=run_file("{run}", RUN_FOLDER.SUMMARY),
        metrics=run_file("{run}", RUN_FOLDER.METRICS),
    params:
        # a finished run is restored, not retrained, unless train itself is forced (a function of the input: no trigger)
        stage_config=lambda wildcards, input: config_args(wildcards, input)
        + (["--retrain"] if forced("train", [run_file(wildcards.run, RUN_FOLDER.SUMMARY),
                                             run_file(wildcards.run, RUN_FOLDER.METRICS)]) else []),
        data=lambda wildcards, input: os.path.dirname(input.data),
        run_dir=lambda wildcards, output: os.path.dirname(output.summary),
        config=rerun_by("train"),
    resources:
        gpu=TRAIN_GPUS,
    log:
        LOGS / "train" / "{run}.log",
    benchmark:
        BENCH / "train" / "{run}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash train {params.stage_config:q} --data {params.data:q} --run-dir {params.run_dir:q} --log {log:q}"
