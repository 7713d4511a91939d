# Rules of stage 'data': thin shell lines calling python -m dflash data; each appends its outputs to ALL_TARGETS.
import os

DATA_DIR = f"{RESULTS}/data/{DATASET}"


rule data:
    input:
        # only the sections that shape the data rerun it (params); the target folder's own changes do too
        config=ancient(CONFIG_FILE),
        target=TARGET_DIR,
    output:
        f"{DATA_DIR}/manifest.json",
    params:
        out=lambda wildcards, output: os.path.dirname(output[0]),
        data=section("data"),
        block_size=config["drafter"]["block_size"],
        seed=config["seed"],
    threads: 1
    log:
        f"{RESULTS}/logs/data-{DATASET}.log",
    benchmark:
        f"{RESULTS}/benchmarks/data-{DATASET}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash data --config {input.config} --out {params.out} --threads {threads} --no-progress"
        " > {log} 2>&1"


ALL_TARGETS.append(f"{DATA_DIR}/manifest.json")
