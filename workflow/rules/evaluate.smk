# Stage 'evaluate': speculative decoding of held-out prompts with the target and the run's newest checkpoint;
# writes acceptance.json (tau, its distribution, tokens/s, losslessness). One thin shell line; the logic lives
# in dflash/evaluate/.
import os


rule evaluate:
    input:
        config=ancient(CONFIG_FILE),
        summary=f"{RESULTS}/runs/{RUN}/summary.json",
        target=TARGET_DIR,
        data=f"{RESULTS}/data/{DATASET}/manifest.json",
        prompts=config["evaluate"]["prompt_files"],
    output:
        f"{RESULTS}/runs/{RUN}/acceptance.json",
    params:
        holdout=lambda wildcards, input: os.path.join(os.path.dirname(input.data), "holdout.jsonl"),
        evaluate=section("evaluate"),
        drafter=section("drafter"),
    log:
        f"{RESULTS}/logs/evaluate/{RUN}.log",
    benchmark:
        f"{RESULTS}/benchmarks/evaluate/{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash evaluate --config {input.config} --holdout {params.holdout} --out {output} --no-progress"
        " > {log} 2>&1"


ALL_TARGETS.append(f"{RESULTS}/runs/{RUN}/acceptance.json")
# The report reads tau from acceptance.json. report.smk (included after this file) defines the list with the same
# define-if-missing line, so the include order does not matter.
REPORT_EXTRA_INPUTS = globals().get("REPORT_EXTRA_INPUTS", [])
REPORT_EXTRA_INPUTS.append(f"{RESULTS}/runs/{RUN}/acceptance.json")
