# Rules of stage 'target': thin shell lines calling python -m dflash target; each appends its outputs to ALL_TARGETS.
# build none: no rule; target.path must already hold a model folder (the data rule takes it as input).
TARGET_DIR = config["target"]["path"]

if config["target"]["build"] != "none":

    rule target:
        input:
            # edits elsewhere in the config file must not rebuild the target: only its sections (params) count
            config=ancient(CONFIG_FILE),
        output:
            directory(TARGET_DIR),
        params:
            target=section("target"),
            corpus=json.dumps(config["data"]["builtin_corpus"]["max_conversations"]),
            seed=config["seed"],
        threads: 1
        log:
            f"{RESULTS}/logs/target.log",
        benchmark:
            f"{RESULTS}/benchmarks/target.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash target --config {input.config} --out {output} --threads {threads} --no-progress"
            " > {log} 2>&1"

    ALL_TARGETS.append(TARGET_DIR)
