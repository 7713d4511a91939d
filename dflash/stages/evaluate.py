"""Stage `evaluate`: speculative decoding of held-out prompts with the target and the trained drafter.

Writes results/runs/<run>/acceptance.json: tau (tokens per target verification step, bonus included), its
distribution over 1..block_size, per-position acceptance, speculative vs plain tokens/s, losslessness (greedy
speculative output token-identical to plain greedy decoding), per prompt set. At temperature > 0 tau depends on the
draft policy (evaluate.proposal): each policy decoded has its figures under `by_proposal`, the top-level ones are
`proposal`'s (argmax, what vLLM, SGLang and TensorRT-LLM run, when decoded), `engines` names who runs which. The
logic is in dflash/evaluate/.
"""
import logging

from dflash.config import Loaded

log = logging.getLogger("dflash.evaluate")


OURS = ("drafter", "sets")   # keys of every acceptance.json: an existing --out without them is not the stage's


def add_arguments(p):
    p.add_argument("--run-dir", default=None, help="run folder (default: <results_dir>/runs/<run_name>)")
    p.add_argument("--drafter", default=None,
                   help="a drafter folder: an export or a checkpoint (default: the checkpoint the run ended with, "
                        "as its summary.json names it)")
    p.add_argument("--holdout", default=None,
                   help="held-out prompts (default: <results_dir>/data/<dataset_name>/holdout.jsonl)")
    p.add_argument("--out", default=None, help="output JSON (default: <run-dir>/acceptance.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--same-config", action="store_true",
                   help="refuse a run trained with another config, e.g. by hand with --set (the workflow passes it)")


def run(loaded: Loaded, args) -> int:
    import datetime
    import json
    from pathlib import Path

    import torch

    from dflash import paths
    from dflash.atomic import atomic_write_json, check_file_ours
    from dflash.config import REPO, inside
    from dflash.data.shards import HOLDOUT, MANIFEST, verify_file
    from dflash.errors import UserError, io_error
    from dflash.evaluate import DFlashDraft
    from dflash.families import embed_scale
    from dflash.evaluate import acceptance as A
    from dflash.evaluate import loading as L
    from dflash.records.acceptance import Acceptance, policies
    from dflash.stages import check_run_config
    from dflash.target import load_target, load_tokenizer, resolve_device, stop_token_ids, target_files
    from dflash.train.checkpoint import ended_with, load_drafter

    cfg, ev = loaded.cfg, loaded.cfg.evaluate
    run_dir = Path(args.run_dir) if args.run_dir else paths.run(cfg.results_dir, cfg.run_name)
    out = Path(args.out) if args.out else paths.RunFolder(run_dir).acceptance()
    failed = out.with_name(out.stem + ".failed.json")
    for f in (out, failed):   # before minutes of decoding: a folder, or a file that is not ours, is refused now
        check_file_ours(f, OURS, "evaluate")
    holdout = Path(args.holdout or paths.dataset(cfg.results_dir, cfg.dataset_name) / HOLDOUT)
    if not args.holdout or (holdout.parent / MANIFEST).is_file():   # a dataset's holdout: as the data stage wrote it
        try:
            verify_file(holdout.parent, holdout.name)
        except OSError as e:   # e.g. a folder, or a file this user cannot read
            raise io_error(e, holdout, "read") or e
    if args.same_config and not args.drafter:
        check_run_config(loaded, run_dir)
    path = Path(args.drafter) if args.drafter else ended_with(run_dir)
    trained_on = None if args.drafter else _trained_on(cfg.target, run_dir)
    device, split = resolve_device(ev.device), None
    if cfg.train.target_split > 1:   # a target that does not fit one device: over train's first target group
        from dflash.train.placement import resolve
        split = resolve(cfg.train).target_groups[0]
        device = str(split[0])
        log.info("the target is split over %s (train.target_split), the drafter on %s", ", ".join(map(str, split)),
                 device)
    tok = load_tokenizer(cfg.target)
    target = load_target(cfg.target, device=device, seed=cfg.seed, devices=split)
    dtype = next(target.parameters()).dtype
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    # the drafter's shape is its folder's config.json (a checkpoint or an export), never the YAML's drafter keys
    drafter = load_drafter(path, embed, head, device=device, dtype=dtype, embed_scale=embed_scale(target.config)).eval()
    source, step = str(path), paths.checkpoint_step(path)
    draft = DFlashDraft(drafter)
    bsz, mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
    stops = stop_token_ids(tok, target)

    sets = {"holdout": L.read_holdout(holdout, ev.num_prompts)}
    for f in ev.prompt_files:
        path = inside(f, REPO, cfg.results_dir)
        name = path.stem
        while name in sets:
            name += "_"
        sets[name] = L.read_prompt_file(path, tok, int(target.config.vocab_size))
    total = sum(len(v) for v in sets.values())
    proposals = policies(ev.proposal, ev.temperature)
    log.info("evaluating drafter %s (block %d) on %d prompt(s) in %d set(s), %d new tokens each, temperature %s "
             "(drafts: %s), %s", source, bsz, total, len(sets), ev.max_new_tokens, ev.temperature,
             " and ".join(proposals), device)

    torch.manual_seed(cfg.seed)
    A.warm_up(target, draft, sets["holdout"][0]["prompt_ids"], stops, mask_id)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="evaluate", unit="prompt")
    results = {}
    try:
        for name, rows in sets.items():
            if bar is not None:
                bar.set_postfix_str(name)
            results[name] = A.evaluate_set(target, draft, [r["prompt_ids"] for r in rows],
                                           max_new_tokens=ev.max_new_tokens, stop_ids=stops,
                                           temperature=ev.temperature, mask_token_id=mask_id, seed=cfg.seed,
                                           proposals=proposals, progress=bar.update if bar is not None else None,
                                           name=name)
            r = results[name]
            for k, b in r["by_proposal"].items():
                log.info("%s (%s drafts): %d prompts, tau %.3f, %.1f tok/s speculative vs %.1f plain, lossless %s",
                         name, k, r["prompts"], b["tau"] or 0, b["speculative"]["tokens_per_s"] or 0,
                         r["plain"]["tokens_per_s"] or 0, r["lossless"])
    finally:
        if bar is not None:
            bar.close()
    overall = A.combine(results, bsz)
    doc = {
        "run_name": cfg.run_name,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "drafter": source, "checkpoint_step": step, "target": str(cfg.target.path),
        "target_files": trained_on or target_files(cfg.target.path), "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "temperature": ev.temperature, "block_size": bsz, "max_new_tokens": ev.max_new_tokens,
        "num_prompts": total, "stop_token_ids": stops,
        **overall,
        "sets": results,
    }
    Acceptance.model_validate_json(json.dumps(doc))   # the file's record, exactly (dflash/records/acceptance.py)
    if not doc["lossless"] and dtype == torch.float32:
        atomic_write_json(failed, doc)
        raise UserError(f"greedy speculative decoding differs from plain greedy decoding on "
                        f"{sum(len(r['mismatches']) for r in results.values())} prompt(s) in float32: a bug "
                        f"(details in {failed})")
    atomic_write_json(out, doc)
    for k, b in doc["by_proposal"].items():
        log.info("tau %.3f (%s drafts, block %d), speculative %.1f tok/s vs plain %.1f tok/s", b["tau"] or 0, k, bsz,
                 b["speculative_tokens_per_s"] or 0, b["plain_tokens_per_s"] or 0)
    log.info("lossless %s -> %s", doc["lossless"], out)
    if not doc["lossless"]:
        log.warning("greedy speculative decoding differs from plain greedy decoding (in %s, batch-dependent "
                    "rounding can flip near-tied argmaxes); details in %s", dtype, out)
    return 0


def _trained_on(target_cfg, run_dir):
    """The fingerprint of the target the run was trained on (summary.json's `target_files`), checked against the
    target folder now: a target changed since is refused, naming the file. None when the summary records none."""
    import json

    from dflash.errors import UserError
    from dflash.paths import RunFolder
    from dflash.target import target_problem
    summary = RunFolder(run_dir).summary
    try:
        files = json.loads(summary.read_text()).get("target_files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, dict):
        return None
    problem = target_problem(target_cfg.path, files)
    if problem:
        raise UserError(f"{problem}, since the run was trained on it ({summary} records its files): its tau would be "
                        f"measured with another target; retrain on it (snakemake -R train), or put the file back")
    return files
