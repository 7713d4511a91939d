# Stage 'report': throughput history, regressions with attribution, anomalies, plots, report.md; then the gate.
# One thin shell line; the logic lives in dflash/report/.
import os

# Extra inputs the report waits for. Other rule files extend it, e.g. the evaluate rule:
#   REPORT_EXTRA_INPUTS.append(f"{RESULTS}/runs/{RUN}/acceptance.json")
# It is read through an input function, so a file included before or after this one can extend it.
REPORT_EXTRA_INPUTS = globals().get("REPORT_EXTRA_INPUTS", [])

REPORT_DIR = f"{RESULTS}/report"


# The per-run snapshots in report/history/ are the record (write-once, not declared outputs); history.csv is a view
# rebuilt from them on every run (update(): Snakemake does not delete it before the job). The report exits 0 whatever
# the verdict, so its outputs always stay; the gate below fails on a regression.
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


# The gate: a separate job after the report, so a failing gate (report.fail_on_regression) keeps report.md, the plots
# and the history. It writes gate.json only when it passes, so a regression fails every `all` until a run recovers.
rule gate:
    input:
        config=ancient(CONFIG_FILE),
        regressions=rules.report.output.regressions,
    output:
        f"{REPORT_DIR}/gate.json",
    params:
        fail=config["report"]["fail_on_regression"],
    log:
        f"{RESULTS}/logs/gate.log",
    conda:
        ENV
    shell:
        "python -m dflash gate --config {input.config:q} --regressions {input.regressions:q} --out {output:q}"
        " > {log:q} 2>&1 || {{ cat {log:q} >&2; exit 3; }}"


# The throughput report and its gate end `all`.
ALL_TARGETS.append(f"{REPORT_DIR}/report.md")
ALL_TARGETS.append(f"{REPORT_DIR}/gate.json")
