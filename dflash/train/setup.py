"""What both runtimes and the warm-up stage share: resolved placement, data, drafter config, the micro-step."""
from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash import fingerprint
from dflash.atomic import read_json
from dflash import paths
from dflash.config import REPO
from dflash.errors import UserError
from dflash.train import compile_guard, placement as P

log = logging.getLogger("dflash.train")


@dataclass
class Setup:
    loaded: object
    placement: P.Placement
    backend: str
    run_dir: Path
    data_dir: Path
    target_config: object      # transformers config of the target
    drafter_config: object     # dflash.model.DrafterConfig
    gamma: float
    env: dict
    compile: bool
    extra: dict = field(default_factory=dict)

    @property
    def cfg(self):
        return self.loaded.cfg


def prepare(loaded, need_data: bool = True, run_dir=None, data_dir=None) -> Setup:
    """Everything a runtime needs; `run_dir` / `data_dir` as the stage was handed them (default: dflash.paths)."""
    from transformers import AutoConfig

    from dflash.model import DrafterConfig, default_gamma
    from dflash.target import load_tokenizer, mask_token_id

    cfg = loaded.cfg
    placement = P.resolve(cfg.train)
    backend = P.attention_backend(cfg.train, placement.drafters)
    if backend == "flex" and any(d.type != "cuda" for d in placement.drafters):
        raise UserError("train.attention is flex but a drafter is on the CPU: flex_attention has no CPU backward; "
                        "use sdpa there")
    tpath = Path(cfg.target.path)
    if not (tpath / "config.json").is_file():
        raise UserError(f"{tpath}: target folder has no config.json (run the target stage, or set target.path)")
    tconf = AutoConfig.from_pretrained(tpath, trust_remote_code=cfg.target.trust_remote_code)
    tok = load_tokenizer(cfg.target)
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else mask_token_id(tok)
    dconf = DrafterConfig.from_target(tconf, cfg.drafter, mask_id)
    env = fingerprint.collect()
    data_dir = Path(data_dir or paths.dataset(cfg.results_dir, cfg.dataset_name))
    run_dir = Path(run_dir or paths.run(cfg.results_dir, cfg.run_name))
    if need_data and not (data_dir / "manifest.json").is_file():
        raise UserError(f"{data_dir}/manifest.json: dataset not found (run the data stage first)")
    use_compile = cfg.train.compile and backend != "eager"
    setup = Setup(loaded, placement, backend, run_dir, data_dir, tconf, dconf,
                 cfg.train.gamma if cfg.train.gamma is not None else default_gamma(dconf.block_size), env, use_compile)
    setup.extra["pad_id"] = tok.pad_token_id if tok.pad_token_id is not None else 0
    return setup


def git_state() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def frozen_head(target_model, device: torch.device):
    """The target's embedding and LM head weights on `device`: the target's own tensors there (shared, never
    copied), one frozen copy on any other device. The drafter takes them as plain tensors."""
    return tuple(m.weight.detach().to(device) for m in
                 (target_model.get_input_embeddings(), target_model.get_output_embeddings()))


def random_head(setup: Setup, device: torch.device, dtype):
    """Stand-ins of the right shape for the warm-up stage (compiled graphs depend on shapes, not values)."""
    v, h = setup.drafter_config.vocab_size, setup.drafter_config.hidden_size
    return tuple(torch.randn(v, h, device=device, dtype=dtype) * 0.02 for _ in range(2))


def build_drafter(setup: Setup, embed, head, device: torch.device):
    from dflash.model import DFlashDrafter
    from dflash.model.export import load_drafter

    init_from = setup.cfg.drafter.init_from
    if init_from:
        drafter = load_drafter(init_from, embed, head, device=device)
    else:
        torch.manual_seed(setup.cfg.seed)
        with torch.device(device):
            drafter = DFlashDrafter(setup.drafter_config, embed, head)
    if setup.compile:
        for layer in drafter.layers:  # compiled in place (state_dict names unchanged); traced in the warm-up
            layer.compile(fullgraph=True, dynamic=False)
    return drafter.to(device).train()


_CE_KERNEL = {}


def ce_kernel(compiled: bool):
    """The fused loss's per-chunk kernel; compiled (once per process, traced in the warm-up) on the compile path."""
    from dflash.model.fused_ce import ce_chunk
    if not compiled:
        return ce_chunk
    if "k" not in _CE_KERNEL:
        _CE_KERNEL["k"] = torch.compile(ce_chunk, fullgraph=True, dynamic=False)
    return _CE_KERNEL["k"]


def micro_step(drafter, feats, input_ids, loss_mask, index: int, setup: Setup, autocast_dtype):
    """Anchors -> drafter forward -> chunked loss for one micro-batch. Anchors are seeded by the batch index,
    so the same batch gets the same anchors in any runtime, replica or resumed run."""
    from dflash.model import block_labels, dflash_loss, sample_anchors

    device = input_ids.device
    gen = torch.Generator(device=device)
    gen.manual_seed(setup.cfg.seed * 1_000_003 + index)
    bk = setup.drafter_config.block_size
    anchors = sample_anchors(loss_mask, setup.cfg.train.num_anchors, bk, gen)
    labels, weights = block_labels(input_ids, loss_mask, anchors, setup.gamma)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        hidden = drafter(feats, input_ids, anchors, backend=setup.backend)
        out = dflash_loss(hidden, drafter.lm_head_weight, labels, weights, bk, setup.cfg.train.loss_chunk,
                          fused=setup.cfg.train.loss_kernel == "fused", kernel=ce_kernel(setup.compile))
    return out


def dummy_batch(setup: Setup, batch: int, length: int, device, dtype):
    """Random features and tokens of one bucket's shape, every position supervised (for warm-up)."""
    k, h = len(setup.drafter_config.target_layer_ids), setup.drafter_config.hidden_size
    g = torch.Generator(device="cpu").manual_seed(length)
    ids = torch.randint(0, setup.drafter_config.vocab_size, (batch, length), generator=g).to(device)
    feats = torch.randn(batch, length, k * h, generator=g).to(device=device, dtype=dtype or torch.float32)
    return feats, ids, torch.ones(batch, length, dtype=torch.bool, device=device)


def warm_up(drafter, setup: Setup, device, shapes) -> dict:
    """Compile (or just run) the drafter's forward and backward for every shape, single-threaded, holding the
    FX guard exclusively. Leaves no gradients behind."""
    dtype = P.autocast_dtype(setup.cfg.train, device)
    before = compile_guard.counters()
    t0 = time.perf_counter()
    per_shape = []
    with compile_guard.FX_GUARD.exclusive():
        compile_guard.allow_compiles()
        compile_guard.configure_thread(len(shapes))
        for b, s in shapes:
            t = time.perf_counter()
            feats, ids, mask = dummy_batch(setup, b, s, device, dtype)
            out = micro_step(drafter, feats, ids, mask, 0, setup, dtype)
            out.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per_shape.append({"batch": b, "length": s, "seconds": round(time.perf_counter() - t, 3)})
        drafter.zero_grad(set_to_none=True)
    after = compile_guard.counters()
    return {"device": str(device), "backend": setup.backend, "compiled": setup.compile, "shapes": per_shape,
            "graphs": after["graphs"] - before["graphs"], "cache_hits": after["cache_hits"] - before["cache_hits"],
            "cache_misses": after["cache_misses"] - before["cache_misses"],
            "seconds": round(time.perf_counter() - t0, 3)}


def data_summary(manifest: dict) -> dict:
    keys = ("content_hash", "num_samples", "total_tokens", "supervised_tokens", "buckets", "length_histogram",
            "bucket_edges", "max_length", "truncation")
    return {k: manifest.get(k) for k in keys}


def read_manifest(setup: Setup) -> dict:
    return read_json(setup.data_dir / "manifest.json")
