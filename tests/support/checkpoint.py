"""A tiny trained drafter and a fake run setup for checkpoint tests."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dflash.train import checkpoint as C, run_folder as R
from support.model import make_drafter, tiny_cfg


def trained(seed=0):
    """A tiny drafter with an optimizer and scheduler that have taken one step (non-empty state)."""
    d = make_drafter(tiny_cfg(), seed=seed)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    sum(p.sum() for p in d.parameters()).backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return d, opt, sched


def fake_setup(tmp_path, steps=12, resume=True, result_hash="c1", data_hash="d1"):
    from dflash.data.shards import write_manifest
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_manifest(data, {"content_hash": data_hash})
    from dflash import config
    cfg = config.from_dict({"train": {"steps": steps, "resume": resume}}).cfg   # a real config: names no input file
    return SimpleNamespace(run_dir=tmp_path / "run", data_dir=data, loaded=SimpleNamespace(result_hash=result_hash),
                           cfg=cfg)


def saved(setup, steps=(4, 8), finished_by=None):
    """Checkpoints `steps` of `setup`'s identity (the last `finished_by`, when given)."""
    d, opt, sched = trained()
    for s in steps:
        C.save(R.home(setup.run_dir, R.identity(setup)), s, s * 2, d, opt, sched, R.identity(setup),
               finished_by=finished_by if s == steps[-1] else None)
    return d, opt, sched
