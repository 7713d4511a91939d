"""The evaluate stage's work: the target and a drafter loaded, every prompt set (the held-out prompts, then
evaluate.prompt_files) decoded speculatively and plainly with each draft policy (evaluate/acceptance.py), and
acceptance.json's record returned (`Acceptance`, dflash/records/acceptance.py); the stage checks its paths and
writes it."""
from __future__ import annotations

import datetime
import logging
from pathlib import Path

import torch

from dflash import paths
from dflash.config import REPO, Loaded, inside
from dflash.data.shards import MANIFEST, verify_file
from dflash.errors import UserError, io_error
from dflash.evaluate import DFlashDraft
from dflash.evaluate import acceptance as A, loading as L
from dflash.families import embed_scale
from dflash.records.acceptance import Acceptance, policies
from dflash.target import load_target, load_tokenizer, resolve_device, stop_token_ids, target_files, target_problem

log = logging.getLogger("dflash.evaluate")


def check_holdout(holdout: Path, given: bool) -> None:
    """A dataset's holdout (the default, or a given file beside a manifest) as the data stage wrote it."""
    if not given or (holdout.parent / MANIFEST).is_file():
        try:
            verify_file(holdout.parent, holdout.name)
        except OSError as e:   # e.g. a folder, or a file this user cannot read
            raise io_error(e, holdout, "read") or e


def trained_on(target_cfg, folder: paths.RunFolder) -> dict | None:
    """The fingerprint of the target the run was trained on (summary.json's `target_files`), checked against the
    target folder now: a target changed since is refused, naming the file. None when the summary records none."""
    import json
    try:
        files = json.loads(folder.summary.read_text()).get("target_files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, dict):
        return None
    problem = target_problem(target_cfg.path, files)
    if problem:
        raise UserError(f"{problem}, since the run was trained on it ({folder.summary} records its files): its tau "
                        f"would be measured with another target; retrain on it (snakemake -R train), or put the file "
                        f"back")
    return files


def evaluate(loaded: Loaded, drafter_path: Path, load_drafter, holdout: Path, trained: dict | None, split,
             progress: bool) -> Acceptance:
    """acceptance.json's record of the drafter at `drafter_path` (a checkpoint or an export, read by
    `load_drafter(embed, head, device=, dtype=, embed_scale=)`, train/checkpoint.py's for that folder: its shape is
    its config.json, never the YAML's drafter keys) on the prompt sets; `trained` the fingerprint of the target
    the run trained on (None: the target's now); `split` the devices of a target split over several (train's first
    target group, train.target_split), else None."""
    cfg, ev = loaded.cfg, loaded.cfg.evaluate
    device = resolve_device(ev.device) if split is None else str(split[0])
    if split is not None:
        log.info("the target is split over %s (train.target_split), the drafter on %s", ", ".join(map(str, split)),
                 device)
    tok = load_tokenizer(cfg.target)
    target = load_target(cfg.target, device=device, seed=cfg.seed, devices=split)
    dtype = next(target.parameters()).dtype
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    drafter = load_drafter(embed, head, device=device, dtype=dtype, embed_scale=embed_scale(target.config)).eval()
    bsz, stops = drafter.cfg.block_size, stop_token_ids(tok, target)
    sets = _prompt_sets(cfg, holdout, tok, int(target.config.vocab_size))
    proposals = policies(ev.proposal, ev.temperature)
    total = sum(len(v) for v in sets.values())
    log.info("evaluating drafter %s (block %d) on %d prompt(s) in %d set(s), %d new tokens each, temperature %s "
             "(drafts: %s), %s", drafter_path, bsz, total, len(sets), ev.max_new_tokens, ev.temperature,
             " and ".join(proposals), device)
    results = _decode(cfg, target, DFlashDraft(drafter), sets, stops, proposals, progress)
    return Acceptance(
        run_name=cfg.run_name,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        drafter=str(drafter_path), checkpoint_step=paths.checkpoint_step(drafter_path), target=str(cfg.target.path),
        target_files=trained or target_files(cfg.target.path), device=str(device),
        dtype=str(dtype).removeprefix("torch."), temperature=ev.temperature, block_size=bsz,
        max_new_tokens=ev.max_new_tokens, num_prompts=total, stop_token_ids=stops,
        **A.combine(results, bsz), sets=results)


def _prompt_sets(cfg, holdout: Path, tok, vocab_size: int) -> dict[str, list[dict]]:
    """{name: prompt rows}: `holdout` (evaluate.num_prompts of it), then each of evaluate.prompt_files by its stem."""
    sets = {"holdout": L.read_holdout(holdout, cfg.evaluate.num_prompts)}
    for f in cfg.evaluate.prompt_files:
        path = inside(f, REPO, cfg.results_dir)
        name = path.stem
        while name in sets:
            name += "_"
        sets[name] = L.read_prompt_file(path, tok, vocab_size)
    return sets


def _decode(cfg, target, draft, sets: dict, stops, proposals, progress: bool) -> dict[str, dict]:
    """{set: its figures} (A.evaluate_set), after one untimed warm-up decode, one progress bar over every prompt."""
    ev, mask_id = cfg.evaluate, draft.drafter.cfg.mask_token_id
    torch.manual_seed(cfg.seed)
    A.warm_up(target, draft, sets["holdout"][0]["prompt_ids"], stops, mask_id)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(len(v) for v in sets.values()), desc="evaluate", unit="prompt")
    results = {}
    try:
        for name, rows in sets.items():
            if bar is not None:
                bar.set_postfix_str(name)
            results[name] = r = A.evaluate_set(
                target, draft, [r["prompt_ids"] for r in rows], max_new_tokens=ev.max_new_tokens, stop_ids=stops,
                temperature=ev.temperature, mask_token_id=mask_id, seed=cfg.seed, proposals=proposals,
                progress=bar.update if bar is not None else None, name=name)
            for k, b in r["by_proposal"].items():
                log.info("%s (%s drafts): %d prompts, tau %.3f, %.1f tok/s speculative vs %.1f plain, lossless %s",
                         name, k, r["prompts"], b["tau"] or 0, b["speculative"]["tokens_per_s"] or 0,
                         r["plain"]["tokens_per_s"] or 0, r["lossless"])
    finally:
        if bar is not None:
            bar.close()
    return results
