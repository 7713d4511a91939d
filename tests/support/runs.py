"""A run folder as train leaves it, for the stages that read one (evaluate, export): no training needed."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from support.data import target_section


def evaluable_run(tmp_path: Path, tiny_target: Path, questions, steps, evaluate: dict, summary: dict | None = None):
    """Checkpoints `steps` of a random one-layer block-4 drafter and a summary.json naming the last (with `summary`'s
    keys too), a dataset folder whose holdout.jsonl holds `questions` as chat prompts, and the config file (its
    `evaluate` section given). Returns (config file, run folder, drafter)."""
    from transformers import AutoConfig

    from dflash import config as C
    from dflash.data.shards import write_manifest
    from dflash.model import DFlashDrafter, DrafterConfig
    from dflash.target import load_tokenizer, mask_token_id
    from dflash.train import checkpoint, run_folder
    raw = {"results_dir": str(tmp_path / "results"), "run_name": "t", "target": target_section(tiny_target),
           "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [0, 1]},
           "evaluate": {**evaluate, "device": "cpu"}}
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    loaded = C.from_dict(raw)
    tok = load_tokenizer(loaded.cfg.target)
    hold = tmp_path / "results" / "data" / "default" / "holdout.jsonl"
    hold.parent.mkdir(parents=True)
    with open(hold, "w") as f:
        for i, q in enumerate(questions):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            f.write(json.dumps({"id": f"h{i}", "source": "test", "prompt_ids": list(ids), "reference_ids": []}) + "\n")
    write_manifest(hold.parent, {"content_hash": "abcdef0123456789", "holdout": len(questions)})
    tconf = AutoConfig.from_pretrained(tiny_target)
    dcfg = DrafterConfig.from_target(tconf, loaded.cfg.drafter, mask_token_id(tok, int(tconf.vocab_size)))
    torch.manual_seed(0)
    d = DFlashDrafter(dcfg, torch.zeros(dcfg.vocab_size, dcfg.hidden_size), torch.zeros(dcfg.vocab_size, dcfg.hidden_size))
    opt = torch.optim.AdamW(d.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run_dir = tmp_path / "results" / "runs" / "t"
    ident = {"result_hash": loaded.result_hash, "data_hash": "abcdef0123456789", "inputs_hash": None}
    home = run_folder.home(run_dir, ident)
    for step in steps:
        checkpoint.save(home, step, step, d, opt, sched, ident)
    final = checkpoint.describe(run_dir, checkpoint.step_dir(home, steps[-1]))
    (run_dir / "summary.json").write_text(json.dumps({"run_id": "t-1", "status": "completed", "steps": steps[-1],
                                                       **(summary or {}), "checkpoint": final}))
    return cfg_file, run_dir, d
