# Stage 'report': throughput and quality history, regressions of Ktok/s and tau with attribution, anomalies, plots,
# report.md; then the gate.
# One thin shell line; the logic lives in dflash/report/. The report follows the config's own run (`snakemake gate` is
# the pipeline alone); a sweep's finished runs land in its history too (it reads every run folder).
REPORT_DIR = f"{RESULTS}/report"


# The per-run snapshots in report/history/ are the record (not declared outputs: a summary is written once, its
# evaluation follows acceptance.json); history.csv is a view rebuilt from them on every run (update(): Snakemake does
# not delete it before the job, and its rows restore lost snapshots). The report exits 0 whatever the verdict, so its
# outputs always stay; the gate below fails on a regression of Ktok/s or tau.
rule report:
    input:
        summary=run_file(RUN, RUN_FOLDER.SUMMARY),
        metrics=run_file(RUN, RUN_FOLDER.METRICS),  # the latest run's training curves
        acceptance=run_file(RUN, RUN_FOLDER.ACCEPTANCE),  # tau: a re-evaluation reruns the report
        drafter=run_file(RUN, RUN_FOLDER.DRAFTER),  # report.md says where the exported drafter is: after the export
        stamp=stamp("report"),
    output:
        md=report(f"{REPORT_DIR}/report.md", caption="../report/report_md.rst", category="Throughput"),
        history=report(update(f"{REPORT_DIR}/history.csv"), caption="../report/history.rst", category="Throughput"),
        regressions=report(
            f"{REPORT_DIR}/regressions.json", caption="../report/regressions.rst", category="Throughput"
        ),
        ktok=report(f"{REPORT_DIR}/ktok_history.png", caption="../report/ktok_history.rst", category="Throughput"),
        tau=report(f"{REPORT_DIR}/tau_history.png", caption="../report/tau_history.rst", category="Quality"),
        time_split=report(f"{REPORT_DIR}/time_split.png", caption="../report/time_split.rst", category="Throughput"),
        devices=report(f"{REPORT_DIR}/devices_latest.png", caption="../report/devices_latest.rst", category="Latest run"),
        training=report(
            f"{REPORT_DIR}/training_latest.png", caption="../report/training_latest.rst", category="Latest run"
        ),
    params:
        stage_config=config_args,
        runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.summary)),
        out=lambda wildcards, output: os.path.dirname(output.md),
        config=rerun_by("report"),
    log:
        f"{RESULTS}/logs/report.log",
    benchmark:
        f"{RESULTS}/benchmarks/report.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash report {params.stage_config:q} --runs-dir {params.runs_dir:q} --out {params.out:q} --log {log:q}"


# The sweep's table (only with a sweep): every run's tau at each temperature and draft policy, its seed group's mean
# and spread, which groups beat the spread, tau against training GPU-seconds; sweep.json is the record behind them. Its
# stamp holds the sweep's runs, overrides and baseline, so a changed runs sheet rewrites it.
if SWEEP.declared:

    rule sweep_table:
        input:
            summaries=[run_file(r, RUN_FOLDER.SUMMARY) for r in RUNS],
            metrics=[run_file(r, RUN_FOLDER.METRICS) for r in RUNS],
            evaluations=[e for r in RUNS for e in evaluations(r)],
            stamp=stamp("sweep_table", extra={"sweep": SWEEP.record()}),
        output:
            md=report(f"{REPORT_DIR}/sweep.md", caption="../report/sweep.rst", category="Sweep"),
            record=f"{REPORT_DIR}/sweep.json",
            plot=report(f"{REPORT_DIR}/sweep_tau_gpu_seconds.png", caption="../report/sweep.rst", category="Sweep"),
        params:
            stage_config=config_args,
            runs_dir=lambda wildcards, input: os.path.dirname(os.path.dirname(input.summaries[0])),
            out=lambda wildcards, output: os.path.dirname(output.md),
        log:
            f"{RESULTS}/logs/sweep_table.log",
        benchmark:
            f"{RESULTS}/benchmarks/sweep_table.jsonl"
        conda:
            ENV
        shell:
            "python -m dflash report {params.stage_config:q} --sweep --runs-dir {params.runs_dir:q}"
            " --out {params.out:q} --log {log:q}"


# The gate: a separate job after the report, so a failing gate (report.fail_on_regression) keeps report.md, the plots
# and the history. It writes gate.json only when it passes, so a regression fails every `all` until a run recovers.
rule gate:
    input:
        regressions=rules.report.output.regressions,
        stamp=stamp("gate"),
    output:
        f"{REPORT_DIR}/gate.json",
    params:
        stage_config=config_args,
        config=rerun_by("gate"),
    log:
        f"{RESULTS}/logs/gate.log",
    benchmark:
        f"{RESULTS}/benchmarks/gate.jsonl"
    conda:
        ENV
    shell:
        "python -m dflash gate {params.stage_config:q} --regressions {input.regressions:q} --out {output:q} --log {log:q}"
