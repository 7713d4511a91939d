# Stage 'warmup': one job per drafter device (and, with train.compile_target, per target device) compiles every
# length bucket single-threaded into this environment's Inductor cache: the drafter, the target's captured layers. It
# warms the config's graphs: a sweep's run that changes a compiled graph's key compiles it in its own train job.
rule warmup:
    input:
        env=paths.fingerprint(RESULTS),
        data=manifest(DATASET),  # the config's dataset: its buckets are the shapes compiled
        target=TARGET_BUILT,
        named=reads("warmup"),
        stamp=stamp("warmup"),
    output:
        paths.compile_record(RESULTS, "{device}"),
    params:
        stage_config=config_args,
        data=lambda wildcards, input: os.path.dirname(input.data),
        config=rerun_by("warmup"),
    resources:
        gpu=lambda wildcards: 0 if wildcards.device == "cpu" else 1,
    log:
        LOGS / "warmup" / "{device}.log",
    benchmark:
        BENCH / "warmup" / "{device}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash warmup {params.stage_config:q} --device {wildcards.device:q} --data {params.data:q} --out {output:q}"
        " --log {log:q}"
