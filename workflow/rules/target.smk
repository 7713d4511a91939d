# Stage 'target': build the tiny (or random-weight) target into target.path. With build none there is no rule:
# target.path must already hold a model folder (the data rule takes it as input).
if config["target"]["build"] != "none":

    rule target:
        output:
            directory(TARGET_DIR),
        params:
            stage_config=config_args,
            config=section("target", "seed"),
            corpus=config["data"]["builtin_corpus"]["max_conversations"],
        threads: 1
        log:
            LOGS / "target.log",
        benchmark:
            BENCH / "target.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash target {params.stage_config:q} --out {output:q} --threads {threads} --log {log:q}"
