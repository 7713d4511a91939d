"""A factory of valid synthetic run summaries (docs/architecture.md format) for the report tests."""
import copy
import hashlib
import json
from pathlib import Path

from dflash.config import config_hash, from_dict

BASE_ENV = {
    "python": "3.11.9",
    "packages": {"torch": "2.11.0", "triton": "3.5.0", "transformers": "5.17.0", "datasets": "4.1.0",
                 "numpy": "2.3.0", "pyarrow": "21.0.0", "safetensors": "0.6.0", "tokenizers": "0.22.0",
                 "snakemake": "9.27.1"},
    "cuda": "13.0", "cudnn": 91000,
    "gpu": {"count": 8, "models": ["NVIDIA H200"], "driver": "580.65"},
    "cpu": "Intel Xeon", "platform": "Linux", "executable": "/venv/bin/python", "lock_hash": "aaaaaaaaaaaaaaaa",
}
BASE_DATA = {"num_samples": 1000, "total_tokens": 1_200_000, "supervised_tokens": 800_000,
             "buckets": {"1024": 400, "2048": 400, "3072": 200},
             "length_histogram": {"512": 200, "1024": 200, "2048": 400, "3072": 200},
             "content_hash": "c0ffee0000000000", "created_at": "2026-11-01T00:00:00Z"}
BASE_CONFIG = {"run_name": "demo", "dataset_name": "default", "results_dir": "results", "seed": 0,
               "train": {"batch_size": 8, "lr": 6e-4, "targets": [0, 1, 2, 3, 4], "drafters": [5, 6, 7],
                         "attention": "flex", "runtime": "threads"},
               "report": {"threshold": -0.1}}


def settings(**report):
    """The config's `report` section (schema defaults, these keys overridden), as the report stage hands it over."""
    return from_dict({"report": report}).cfg.report


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def devices(mems=(75.0, 74.0, 76.0), util=80.0):
    out = [{"device": f"cuda:{i}", "roles": ["target"], "peak_memory_gb": 60.0, "util_mean": util} for i in range(5)]
    out += [{"device": f"cuda:{5 + i}", "roles": ["drafter"], "peak_memory_gb": m, "util_mean": util}
            for i, m in enumerate(mems)]
    return out


def workers(drafter_steps=(120, 120, 120)):
    out = [{"name": f"target-{i}", "role": "target", "device": f"cuda:{i}", "steps": 120, "ready_s": 1.0} for i in range(5)]
    out += [{"name": f"drafter-{i}", "role": "drafter", "device": f"cuda:{5 + i}", "steps": s, "ready_s": 2.0}
            for i, s in enumerate(drafter_steps)]
    return out


def summary(n: int, ktok: float = 12.0, *, env=None, data=None, config=None, commit="a" * 40, dirty=False,
            status="completed", recompiles=0, eager=0, mems=(75.0, 74.0, 76.0), util=80.0,
            drafter_steps=(120, 120, 120)) -> dict:
    """Run number n (its start time orders the history); keyword arguments change one thing at a time."""
    env = copy.deepcopy(env or BASE_ENV)
    data = copy.deepcopy(data or BASE_DATA)
    config = copy.deepcopy(config or BASE_CONFIG)
    env["hash"] = _h({k: env.get(k) for k in ("python", "packages", "cuda", "cudnn", "gpu", "lock_hash")})
    measured = 100
    per_step = 1.0 / ktok
    return {
        "run_id": f"demo-202611{n:02d}T100000Z", "run_name": "demo",
        "started_at": f"2026-11-{n:02d}T10:00:00Z", "finished_at": f"2026-11-{n:02d}T11:00:00Z",
        "status": status, "git": {"commit": commit, "dirty": dirty},
        "config_hash": config_hash(config), "config": config,
        "env_hash": env["hash"], "env": env,
        "data_hash": _h({k: v for k, v in data.items() if k != "created_at"}), "data": data,
        "runtime": "threads", "steps": 120, "measured_steps": measured,
        "throughput": {"ktok_per_s": ktok, "samples_per_s": ktok * 0.8, "draft_positions_per_s": ktok * 500, "mfu": 0.3 * ktok / 12},
        # seconds per optimizer step (as train writes it)
        "time_split_s": {"queue_wait": 2.0 * per_step, "target": 5.0 * per_step, "drafter": 4.0 * per_step,
                         "optimizer": 1.0 * per_step},
        "loss": 2.5, "acc_per_position": [0.8 - 0.03 * k for k in range(15)], "acceptance_estimate": 5.5,
        "workers": workers(drafter_steps), "devices": devices(mems, util),
        "compile": {"graphs": 3, "warmup_s": 40.0, "cache_hits": 3, "recompiles_after_warmup": recompiles,
                    "eager_fallbacks": eager},
        "queue_depth_mean": 3.0,
    }


def acceptance(s: dict, tau: float, minutes: int = 5, **settings) -> dict:
    """An acceptance.json of run `s` made `minutes` after it finished (evaluate's keys; `settings` override them)."""
    return {"run_name": s["run_name"], "created_at": s["finished_at"].replace(":00:00Z", f":{minutes:02d}:00+00:00"),
            "temperature": 0.0, "block_size": 16, "max_new_tokens": 64, "num_prompts": 16, "dtype": "float32",
            "device": "cpu", "tau": tau, "sets": {"holdout": {"tau": tau}}, **settings}


def write_run(runs_dir: Path, s: dict, folder: str | None = None, tau: float | None = 6.2, metrics: bool = True,
              evaluation: dict | None = None) -> Path:
    """A run folder: summary.json, acceptance.json (`evaluation`, else a bare {"tau": tau}), metrics.jsonl."""
    d = Path(runs_dir) / (folder or s["run_id"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "summary.json").write_text(json.dumps(s))
    if evaluation is not None or tau is not None:
        (d / "acceptance.json").write_text(json.dumps(evaluation if evaluation is not None else {"tau": tau}))
    if metrics:
        rows = [{"step": st, "elapsed_s": st * 1.0, "loss": 5.0 / (1 + st / 20), "lr": 6e-4, "grad_norm": 1.0,
                 "ktok_per_s": s["throughput"]["ktok_per_s"], "acc_per_position": [min(0.9, st / 150) * (1 - k / 20) for k in range(15)],
                 "acceptance_estimate": 4.0, "time_split_s": s["time_split_s"], "queue_depth": 3}
                for st in range(10, 130, 10)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def with_pkg(name, version):
    env = copy.deepcopy(BASE_ENV)
    env["packages"][name] = version
    return env
