# Rules of stage 'data': thin shell lines calling python -m dflash data; each appends its outputs to ALL_TARGETS.
# data.shards = 1: one job. data.shards = N > 1: N scatter jobs `data_part` (reading, regeneration, tokenising of
# shard I; each its own GPU with engine hf, or its share of the servers with engine openai) and one gather job
# `data` (length buckets, holdout, manifest). The content hash is the same for any N.
import os

DATA_DIR = f"{RESULTS}/data/{DATASET}"
DATA_SHARDS = int(config["data"].get("shards", 1))
_regen = config["data"].get("regenerate", {})
# a GPU per job only when it generates in-process on a GPU (openai: the servers hold the GPUs)
DATA_GPU = int(_regen.get("enabled", True) and _regen.get("engine", "hf") == "hf"
               and str(_regen.get("device", "auto")) != "cpu")
DATA_PARTS = [f"{RESULTS}/data/{DATASET}.parts/part-{i}-of-{DATA_SHARDS}" for i in range(DATA_SHARDS)]


if DATA_SHARDS > 1:

    rule data_part:
        input:
            config=ancient(CONFIG_FILE),
            target=TARGET_DIR,
        output:
            temp(directory(f"{RESULTS}/data/{DATASET}.parts/part-{{shard}}-of-{DATA_SHARDS}")),   # removed once gathered
        params:
            shards=DATA_SHARDS,
            data=section("data"),
            block_size=config["drafter"]["block_size"],
            seed=config["seed"],
        wildcard_constraints:
            shard=r"\d+",
        threads: 1
        resources:
            gpu=DATA_GPU,
        log:
            f"{RESULTS}/logs/data-{DATASET}/part-{{shard}}.log",
        benchmark:
            f"{RESULTS}/benchmarks/data-{DATASET}/part-{{shard}}.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash data --config {input.config} --shard {wildcards.shard}/{params.shards} --out {output}"
            " --threads {threads} --no-progress > {log} 2>&1"

    rule data:
        input:
            config=ancient(CONFIG_FILE),
            target=TARGET_DIR,
            parts=DATA_PARTS,
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
            "python -m dflash data --config {input.config} --gather {input.parts} --out {params.out} --no-progress"
            " > {log} 2>&1"

else:

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
        resources:
            gpu=DATA_GPU,
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
