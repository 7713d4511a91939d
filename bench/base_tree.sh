#!/usr/bin/env bash
# Another commit's tree to measure against on the same lent machine, in the same call: lent machines differ by a few
# percent (3.5% for one bf16 run, bench/results/2026-12-04-h200-r9), more than most single changes gain.
#   bash bench/base_tree.sh REV     # REV's tracked files into .base/ (git-ignored), REV's full hash in .base/BASE_REV
# The device tool's `carry: [".base", ".whl"]` takes it along. On the device (after bench/device_wheels.sh's install),
# the base first, then this tree, each with its own package and results/:
#   (cd .base && PYTHONPATH=/tmp/site:$PWD python3 bench/h200.py --out $OUT/base --sections e2e --steps 200)
#   PYTHONPATH=/tmp/site:$PWD python3 bench/h200.py --out $OUT/new --sections e2e --steps 200
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: bash bench/base_tree.sh REV}"
full=$(git rev-parse --verify -q "$rev^{commit}") ||
    { echo "base_tree: $rev is not a commit of this repository" >&2; exit 2; }
rm -rf .base
mkdir .base
git archive "$full" | tar -x -C .base
echo "$full" > .base/BASE_REV
echo ".base/: $rev = $full ($(du -sh .base | cut -f1))"
