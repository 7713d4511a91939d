# Stage 'data': expand the sources into tokenised, bucketed Arrow shards. Local source files are inputs, so an
# edited source reruns data onward; hub datasets are not tracked.

rule data:
    input:
        target=TARGET_DIR,
        sources=lambda wildcards: [s["path"] for s in config["data"]["sources"] if s["kind"] != "hub"],
    output:
        manifest=paths.dataset(RESULTS, DATASET) / "manifest.json",
    params:
        stage_config=config_args,
        out=lambda wildcards, output: os.path.dirname(output.manifest),
        config=section("data", "target", "seed"),
        block_size=config["drafter"]["block_size"],
    threads: 1
    log:
        LOGS / f"data-{DATASET}.log",
    benchmark:
        BENCH / f"data-{DATASET}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash data {params.stage_config:q} --out {params.out:q} --threads {threads} --log {log:q}"
