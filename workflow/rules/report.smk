# Stage 'report': throughput history (append-only), regressions with attribution, anomalies, plots, report.md.
REPORT_DIR = paths.report(RESULTS)


# history.csv is append-only across runs: update() keeps Snakemake from deleting it before the job (and restores
# it if the job fails). The per-run snapshots in report/history/ are write-once and not declared outputs.
rule report:
    input:
        summary=rules.train.output.summary,
        acceptance=rules.evaluate.output[0],  # the report reads tau
    output:
        md=report(REPORT_DIR / "report.md", caption="../report/report_md.rst", category="Throughput"),
        history=report(update(REPORT_DIR / "history.csv"), caption="../report/history.rst", category="Throughput"),
        regressions=report(
            REPORT_DIR / "regressions.json", caption="../report/regressions.rst", category="Throughput"
        ),
        ktok=report(REPORT_DIR / "ktok_history.png", caption="../report/ktok_history.rst", category="Throughput"),
        time_split=report(REPORT_DIR / "time_split.png", caption="../report/time_split.rst", category="Throughput"),
        devices=report(REPORT_DIR / "devices_latest.png", caption="../report/devices_latest.rst", category="Latest run"),
        training=report(
            REPORT_DIR / "training_latest.png", caption="../report/training_latest.rst", category="Latest run"
        ),
    params:
        stage_config=config_args,
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.summary)),
        out=lambda wildcards, output: os.path.dirname(output.md),
        config=section("report"),
    log:
        LOGS / "report.log",
    benchmark:
        BENCH / "report.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash report {params.stage_config:q} --runs-dir {params.runs_dir:q} --out {params.out:q} --log {log:q}"
