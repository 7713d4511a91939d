# Stage 'export': the trained drafter in the reference inference format (+ README.md model card) under
# results/runs/<run>/drafter/. One thin shell line; the logic lives in dflash/stages/export.py.
rule export:
    input:
        config=ancient(CONFIG_FILE),
        summary=f"{RESULTS}/runs/{RUN}/summary.json",
        acceptance=f"{RESULTS}/runs/{RUN}/acceptance.json",  # the model card states tau
        target=TARGET_DIR,
    output:
        directory(f"{RESULTS}/runs/{RUN}/drafter"),
    params:
        drafter=section("drafter"),
    log:
        f"{RESULTS}/logs/export/{RUN}.log",
    benchmark:
        f"{RESULTS}/benchmarks/export/{RUN}.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash export --config {input.config} --out {output} > {log} 2>&1"


ALL_TARGETS.append(f"{RESULTS}/runs/{RUN}/drafter")
