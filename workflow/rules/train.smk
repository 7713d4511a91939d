# Training: the threads runtime in one process, or (runtime distributed) one process per GPU under torchrun,
# launched by the stage itself.
rule train:
    input:
        config=ancient(CONFIG_FILE),
        env=f"{RESULTS}/env/fingerprint.json",
        data=f"{RESULTS}/data/{DATASET}/manifest.json",
        target=TARGET_DIR,
        warmup=expand(f"{RESULTS}/compile/{{device}}.json", device=DRAFTER_DEVICES),
    output:
        summary=f"{RESULTS}/runs/{RUN}/summary.json",
        metrics=f"{RESULTS}/runs/{RUN}/metrics.jsonl",
    params:
        drafter=section("drafter"),
        train=section("train"),
    resources:
        gpu=TRAIN_GPUS,
    log:
        f"{RESULTS}/logs/train/{RUN}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train/{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash train --config {input.config} --no-progress > {log} 2>&1"


ALL_TARGETS.append(f"{RESULTS}/runs/{RUN}/summary.json")
