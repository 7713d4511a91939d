#!/usr/bin/env bash
# One device call of config/quality.yaml's workflow on a lent GPU (the device tool runs it in the repo root):
#   bash bench/quality_device.sh BUDGET_S [SNAKEMAKE ARGUMENTS, e.g. targets or --config 'sweep={only: [muon*]}']
# Installs the carried wheels once (.whl/: bench/device_wheels.sh), prints the GPU and versions, then runs
#   snakemake --cores all --resources gpu=1 --configfile config/quality.yaml --rerun-incomplete ARGUMENTS
# (one GPU job at a time) for at most BUDGET_S seconds. At the budget its process group gets SIGTERM: a train job
# checkpoints and stops (train.stop_timeout_s), and the next call's --rerun-incomplete resumes it from there (the train
# stage's own resume; its time budget counts the training seconds of every call); SIGKILL 30 s later. results/ stays
# while the machine does. What comes back under $OUT: the sweep table (sweep.md, sweep.json, its plot), report.md, and
# one archive of the runs' records and every log.
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:?usage: bash bench/quality_device.sh BUDGET_S [snakemake arguments]}
shift
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
snake=(python3 -m snakemake --configfile config/quality.yaml)
"${snake[@]}" --unlock >/dev/null 2>&1   # a call cut by its budget leaves the lock
setsid "${snake[@]}" --cores all --resources gpu=1 --rerun-incomplete "$@" &
pid=$!
( sleep "$budget"; kill -TERM -- "-$pid" 2>/dev/null; sleep 30; kill -KILL -- "-$pid" 2>/dev/null ) &
watchdog=$!
wait "$pid"
rc=$?
kill "$watchdog" 2>/dev/null
for f in sweep.md sweep.json sweep_tau_gpu_seconds.png report.md; do
    [ -f "results/report/$f" ] && cp "results/report/$f" "$OUT/"
done
python3 bench/common.py archive "$OUT/runs.tgz" results/logs results/benchmarks \
    $(ls -d results/target/*/build.json results/data/*/manifest.json results/runs/*/summary.json results/runs/*/metrics.jsonl \
      results/runs/*/acceptance*.json 2>/dev/null)     # machine paths written portably (bench/common.py portable)
exit $rc
