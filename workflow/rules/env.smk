rule env:
    input:
        config=ancient(CONFIG_FILE),
        pins="envs/requirements.txt",
    output:
        f"{RESULTS}/env/fingerprint.json",
    log:
        f"{RESULTS}/logs/env.log",
    benchmark:
        f"{RESULTS}/benchmarks/env.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash env --config {input.config} --out {output} > {log} 2>&1"
