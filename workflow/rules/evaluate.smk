# Stage 'evaluate': speculative decoding of held-out prompts with the target and the checkpoint a run ended with;
# writes acceptance.json (tau, its distribution, tokens/s, losslessness) at evaluate.temperature, and
# acceptance-t<T>.json at each other temperature of sweep.temperatures. Every run the sweep decodes (sweep.evaluate).
# The job holds a GPU when it decodes on one, so a sweep's runs are measured alone (`--resources gpu=1`).
EVAL_GPU = int(CFG.evaluate.device != "cpu" and (CFG.evaluate.device != "auto" or TRAIN_GPUS > 0))


rule evaluate:
    input:
        summary=run_file("{run}", RUN_FOLDER.SUMMARY),
        target=TARGET_BUILT,
        named=reads("evaluate"),
        stamp=run_stamp("evaluate"),
        data=data_of,
        # hashed in the manifest; a changed file reruns evaluate, which refuses it
        holdout=lambda wildcards: holdout(SWEEP.runs[wildcards.run].dataset),
    output:
        run_file("{run}", RUN_FOLDER.ACCEPTANCE),
    params:
        stage_config=config_args,
        run_dir=lambda wildcards, input: os.path.dirname(input.summary),
        config=rerun_by("evaluate"),
    resources:
        gpu=EVAL_GPU,
    log:
        LOGS / "evaluate" / "{run}.log",
    benchmark:
        BENCH / "evaluate" / "{run}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash evaluate {params.stage_config:q} --run-dir {params.run_dir:q} --holdout {input.holdout:q}"
        " --same-config --out {output:q} --log {log:q}"


# The same at another temperature (sweep.temperatures): the run's config with evaluate.temperature set to it.
use rule evaluate as evaluate_at with:
    output:
        run_file("{run}", RUN_FOLDER.ACCEPTANCE_AT),
    params:
        stage_config=lambda wildcards, input: config_args(wildcards, input)
        + ["--set", f"evaluate.temperature={float(wildcards.temp)}"],
        run_dir=lambda wildcards, input: os.path.dirname(input.summary),
        config=lambda wildcards: trigger(SWEEP.runs[wildcards.run].loaded.raw, "evaluate") + f" T={wildcards.temp}",
    log:
        LOGS / "evaluate" / "{run}-t{temp}.log",
    benchmark:
        BENCH / "evaluate" / "{run}-t{temp}.jsonl"
