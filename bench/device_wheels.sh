#!/usr/bin/env bash
# Downloads, here (with network), the wheels a lent H200 lacks for the benches into .whl/ (git-ignored; the device
# tool's `carry: [".whl"]` takes them along). The device image has torch, transformers, triton, pyarrow, pandas,
# xxhash, rich and tqdm; it lacks datasets, pydantic, jsonschema, torchao (and snakemake for the quality workflow).
#   bash bench/device_wheels.sh              # what bench/h200.py and bench/regen.py import
#   bash bench/device_wheels.sh snakemake    # + snakemake and its needs (bench/quality_device.sh runs the workflow)
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#                export PYTHONPATH=/tmp/site:$PWD
# Versions: envs/requirements.txt's pins, their needs at the versions `make venv` resolves (`.venv/bin/pip list`).
set -euo pipefail
cd "$(dirname "$0")/.."
pins=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 torchao==0.18.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
      referencing==0.37.0 rpds-py==2026.9.1)
if [[ "${1:-}" == snakemake ]]; then
    [[ -x .venv/bin/pip ]] || { echo "make venv first: snakemake's needs are read from .venv" >&2; exit 2; }
    mapfile -t extra < <(.venv/bin/python - <<'PY'
import importlib.metadata as md, re
from packaging.requirements import Requirement
seen, todo, have = set(), ["snakemake"], {"torch", "transformers", "pyarrow", "pandas", "numpy", "pyyaml", "rich",
                                        "tqdm", "psutil", "requests", "packaging", "jinja2", "markupsafe"}
device = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
while todo:
    name = todo.pop()
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen or key in have:
        continue
    seen.add(key)
    dist = md.distribution(name)
    print(f"{dist.metadata['Name']}=={dist.version}")
    for req in map(Requirement, dist.requires or []):
        if req.marker is None or req.marker.evaluate(device):   # what the device's Python 3.12 needs, no extras
            todo.append(req.name)
PY
)
    pins+=("${extra[@]}")
fi
mkdir -p .whl
for p in "${pins[@]}"; do
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        -d .whl "$p" >.whl/.log 2>&1; then
        python3 -m pip wheel -q --no-deps -w .whl "$p"   # published as an sdist only (connection_pool): built here
    fi
    grep -v '^WARNING' .whl/.log || true
done
rm -f .whl/.log
ls .whl | wc -l; du -sh .whl
