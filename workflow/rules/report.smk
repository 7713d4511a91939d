# Stage 'report': throughput history (append-only), regressions with attribution, anomalies, plots, report.md.
# One thin shell line; the logic lives in dflash/report/.
import os

# Extra inputs the report waits for. Other rule files extend it, e.g. the evaluate rule:
#   REPORT_EXTRA_INPUTS.append(f"{RESULTS}/runs/{RUN}/acceptance.json")
# It is read through an input function, so a file included before or after this one can extend it.
REPORT_EXTRA_INPUTS = globals().get("REPORT_EXTRA_INPUTS", [])

REPORT_DIR = f"{RESULTS}/report"


# history.csv is append-only across runs: update() keeps Snakemake from deleting it before the job (and restores
# it if the job fails). The per-run snapshots in report/history/ are write-once and not declared outputs.
rule report:
    input:
        config=CONFIG_FILE,
        summary=f"{RESULTS}/runs/{RUN}/summary.json",
        extra=lambda wildcards: list(REPORT_EXTRA_INPUTS),
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
        "python -m dflash report --config {input.config} --runs-dir {params.runs_dir} --out {params.out} > {log} 2>&1"


# The throughput report ends `all`.
ALL_TARGETS.append(f"{REPORT_DIR}/report.md")
