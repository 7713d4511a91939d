# Stage 'report': throughput history (append-only), regressions with attribution, anomalies, plots, report.md.
# One thin shell line; the logic lives in dflash/report/.
REPORT_DIR = f"{RESULTS}/report"


# history.csv is append-only across runs: update() keeps Snakemake from deleting it before the job (and restores
# it if the job fails). The per-run snapshots in report/history/ are write-once and not declared outputs.
rule report:
    input:
        summary=rules.train.output.summary,
        acceptance=rules.evaluate.output[0],  # the report reads tau
    output:
        md=report(f"{REPORT_DIR}/report.md", caption="../report/report_md.rst", category="Throughput"),
        history=report(update(f"{REPORT_DIR}/history.csv"), caption="../report/history.rst", category="Throughput"),
        regressions=report(
            f"{REPORT_DIR}/regressions.json", caption="../report/regressions.rst", category="Throughput"
        ),
        ktok=report(f"{REPORT_DIR}/ktok_history.png", caption="../report/ktok_history.rst", category="Throughput"),
        time_split=report(f"{REPORT_DIR}/time_split.png", caption="../report/time_split.rst", category="Throughput"),
        devices=report(f"{REPORT_DIR}/devices_latest.png", caption="../report/devices_latest.rst", category="Latest run"),
        training=report(
            f"{REPORT_DIR}/training_latest.png", caption="../report/training_latest.rst", category="Latest run"
        ),
    params:
        stage_config=config_args,
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.summary)),
        out=lambda wildcards, output: os.path.dirname(output.md),
        report=section("report"),
    log:
        f"{RESULTS}/logs/report.log",
    benchmark:
        f"{RESULTS}/benchmarks/report.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash report {params.stage_config:q} --runs-dir {params.runs_dir:q} --out {params.out:q} --log {log:q}"
