# Stage 'data': expand the sources into tokenised, bucketed Arrow shards. Local source files are inputs and their
# content is in the data stamp, so an edited source reruns data onward; hub datasets are not tracked.
# One dataset per set of data keys: the config's (dataset_name), and one per other set a sweep's runs give
# (results/data/{dataset}/, dflash/sweep.py); each has its own key stamp.
# data.shards = 1: one job per dataset. data.shards = N > 1: N scatter jobs `data_part` (reading, regeneration,
# tokenising of shard I; each its own GPU with engine hf, or its share of the servers with engine openai) and one
# gather job `data` (length buckets, holdout, manifest). The content hash is the same for any N.
DATA_SHARDS = CFG.data.shards
_regen = CFG.data.regenerate
# a GPU per job only when it generates in-process on a GPU (openai: the servers hold the GPUs)
DATA_GPU = int(_regen.enabled and _regen.engine == "hf" and _regen.device != "cpu")
DATA_DIR = paths.dataset(RESULTS, "{dataset}")
DATA_STAMP = data_stamp()


if DATA_SHARDS > 1:

    rule data_part:
        input:
            target=TARGET_BUILT,
            named=reads("data"),
            stamp=DATA_STAMP,
        output:
            temp(directory(f"{DATA_DIR}.parts/part-{{shard}}-of-{DATA_SHARDS}")),
        params:
            stage_config=config_args,
            shard=lambda wildcards: f"{wildcards.shard}/{DATA_SHARDS}",
            config=rerun_by("data"),
        wildcard_constraints:
            shard=r"\d+",
        threads: 1
        resources:
            gpu=DATA_GPU,
        log:
            LOGS / "data-{dataset}" / "part-{shard}.log",
        benchmark:
            BENCH / "data-{dataset}" / "part-{shard}.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash data {params.stage_config:q} --shard {params.shard:q} --out {output:q}"
            " --threads {threads} --log {log:q}"

    rule data:
        input:
            target=TARGET_BUILT,
            named=reads("data"),
            stamp=DATA_STAMP,
            parts=lambda wildcards: [f"{paths.dataset(RESULTS, wildcards.dataset)}.parts/part-{i}-of-{DATA_SHARDS}"
                                     for i in range(DATA_SHARDS)],
        output:
            manifest=DATA_DIR / "manifest.json",
            holdout=DATA_DIR / "holdout.jsonl",
        params:
            stage_config=config_args,
            out=lambda wildcards, output: os.path.dirname(output.manifest),
            config=rerun_by("data"),
        threads: 1
        log:
            LOGS / "data-{dataset}.log",
        benchmark:
            BENCH / "data-{dataset}.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash data {params.stage_config:q} --gather {input.parts:q} --out {params.out:q} --log {log:q}"

else:

    rule data:
        input:
            target=TARGET_BUILT,
            named=reads("data"),
            stamp=DATA_STAMP,
        output:
            manifest=DATA_DIR / "manifest.json",
            holdout=DATA_DIR / "holdout.jsonl",
        params:
            stage_config=config_args,
            out=lambda wildcards, output: os.path.dirname(output.manifest),
            config=rerun_by("data"),
        threads: 1
        resources:
            gpu=DATA_GPU,
        log:
            LOGS / "data-{dataset}.log",
        benchmark:
            BENCH / "data-{dataset}.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash data {params.stage_config:q} --out {params.out:q} --threads {threads} --log {log:q}"
