#!/usr/bin/env bash
# On a lent GPU machine: config/h200.yaml's e2e runs of the old tree (.base/, bench/base_tree.sh) then this tree, run by
# run, on the same machine in one call (lent machines differ by 3.5%: compare only within one call). Both trees share
# one results/ (.base/results is linked to it): the target and data are built once, and the new tree's warm-up finds
# every graph the old tree compiled that it did not change in the Inductor cache.
#   bash bench/old_vs_new.sh OUT RUN [RUN...]     # RUN: names of bench/sections/e2e.py's e2e_runs (1t1d, 1t1d-fp8all)
# Writes OUT/e2e-RUN-{base,new}.json (the bench's records) and OUT/summary-RUN-{base,new}.json; each side is cut by
# `timeout` at BENCH_RUN_TIMEOUT seconds (default 330: a cold fp8all run took 215 s on an H200, its warm-up 127 s).
# Device tool: carry [".whl", ".base"]; the command starts with bench/device_wheels.sh's install line.
# Used for bench/results/2026-12-07-h200-r10 (as .devrun/callB.sh).
set -uo pipefail
out=${1:?usage: bash bench/old_vs_new.sh OUT RUN [RUN...]}; shift
[[ -f .base/BASE_REV ]] || { echo "old_vs_new: no .base/ (bash bench/base_tree.sh REV first)" >&2; exit 2; }
mkdir -p "$out"
rm -rf .base/results && ln -s ../results .base/results
limit=${BENCH_RUN_TIMEOUT:-330}
skip=()
for run in "$@"; do
    for side in base new; do
        dir=$([[ $side == base ]] && echo .base || echo .)
        (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" timeout "$limit" python3 bench/h200.py --out "/tmp/ovn-$run-$side" \
            --sections e2e --steps 200 --opt "e2e.runs=$run" "${skip[@]}") > "$out/e2e-$run-$side.log" 2>&1
        echo "$run $side: exit $? at ${SECONDS}s" | tee -a "$out/times.txt"
        cp "/tmp/ovn-$run-$side/bench.json" "$out/e2e-$run-$side.json" 2>/dev/null
        cp "/tmp/ovn-$run-$side/summary-$run.json" "$out/summary-$run-$side.json" 2>/dev/null
        skip=(--opt e2e.skip_stages=1)   # the target and data are built once
    done
done
