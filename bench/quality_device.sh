#!/usr/bin/env bash
# One device call of the quality bench on a lent H200 (the device tool runs it in the repo root):
#   bash bench/quality_device.sh --parts pipeline --until warmup --budget 540
# Installs the carried wheels once (.whl/, see bench/results/*/README.md), prints the GPU and versions, runs
# bench/quality.py with the given arguments into bench/out/q (kept while the machine stays warm), then copies what
# comes back under $OUT (at most 8 files): the bench's state, table, plot and archive, and one archive of every log.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 bench/quality.py --out bench/out/q "$@"
rc=$?
for f in quality-state.json quality.json quality.md quality.png tau-gpu-seconds.png runs.tar.gz; do
    [ -f "bench/out/q/$f" ] && cp "bench/out/q/$f" "$OUT/"
done
tar czf "$OUT/logs.tgz" bench/out/q/logs results/logs results/benchmarks \
    $(ls -d results/target/*/build.json results/data/*/manifest.json results/runs/*/summary.json results/runs/*/metrics.jsonl \
      results/runs/*/acceptance*.json results/report/report.md 2>/dev/null) 2>/dev/null
exit $rc
