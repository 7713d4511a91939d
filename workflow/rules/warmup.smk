# One job per drafter device: compile every length bucket single-threaded into this environment's Inductor cache.
rule warmup:
    input:
        config=ancient(CONFIG_FILE),
        env=f"{RESULTS}/env/fingerprint.json",
        data=f"{RESULTS}/data/{DATASET}/manifest.json",
        target=TARGET_DIR,
    output:
        f"{RESULTS}/compile/{{device}}.json",
    params:
        drafter=section("drafter"),
        train=section("train"),
    resources:
        gpu=lambda wildcards: 0 if wildcards.device == "cpu" else 1,
    log:
        f"{RESULTS}/logs/warmup/{{device}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/warmup/{{device}}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash warmup --config {input.config} --device {wildcards.device} --out {output} > {log} 2>&1"


ALL_TARGETS += expand(f"{RESULTS}/compile/{{device}}.json", device=DRAFTER_DEVICES)
