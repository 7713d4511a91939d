"""Stage `export`: the trained drafter in the reference inference format (config.json + model.safetensors, as
z-lab `dflash` 0.1.0 `DFlashDraftModel`, SGLang and vLLM load it) plus a README.md model card, under
results/runs/<run>/drafter/ (written in one rename, its files' modes as the umask gives: readable by a server under
another account) and export.json, the stage's record (the checkpoint, every file's size and sha256). A folder without
export.json, or holding a file the stage did not write, is never replaced: it is refused, naming them."""
import logging
from pathlib import Path

from dflash import paths
from dflash.atomic import atomic_dir, atomic_write_json, check_ours, describe_files, read_json
from dflash.config import Loaded
from dflash.errors import UserError
from dflash.stages import check_run_config

log = logging.getLogger("dflash.export")

RECORD = "export.json"


def check_out(out) -> None:
    """Where export may write its folder: nowhere that holds what it did not write (`dflash.atomic.check_ours`).
    Checked before anything loads; the Snakefile can call it when it is read, before Snakemake removes the output."""
    check_ours(out, RECORD, "give --out a new folder, or the run's drafter folder")


def add_arguments(p):
    p.add_argument("--run-dir", default=None, help="run folder (default: <results_dir>/runs/<run_name>)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder (default: the one the run ended with, as its summary.json names it)")
    p.add_argument("--data", default=None, help="dataset folder, for the model card (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--out", default=None, help="output folder (default: <run-dir>/drafter)")
    p.add_argument("--same-config", action="store_true",
                   help="refuse a run trained with another config, e.g. by hand with --set (the workflow passes it)")
    p.add_argument("--dtype", choices=["keep", "float32", "bfloat16"], default="keep",
                   help="cast the weights (default: as trained)")


def run(loaded: Loaded, args) -> int:
    import torch
    from transformers import AutoConfig

    from dflash.evaluate.modelcard import model_card, stated
    from dflash.model import serving_problems
    from dflash.model.export import write_drafter
    from dflash.target import check_target, load_tokenizer
    from dflash.train.checkpoint import ended_with, load_drafter

    cfg = loaded.cfg
    folder = paths.RunFolder(args.run_dir or paths.run(cfg.results_dir, cfg.run_name))
    out = Path(args.out) if args.out else folder.drafter
    check_out(out)
    if args.same_config and not args.checkpoint:
        check_run_config(loaded, folder)
    ckpt = Path(args.checkpoint) if args.checkpoint else ended_with(folder)
    tpath = Path(cfg.target.path)
    check_target(cfg.target)
    if not (tpath / "config.json").is_file():
        raise UserError(f"{tpath}: target folder has no config.json (run the target stage, or set target.path)")
    tconf = AutoConfig.from_pretrained(str(tpath), trust_remote_code=cfg.target.trust_remote_code)
    # the drafter's shape is the checkpoint's config.json, never the YAML's drafter keys; the embedding and LM head
    # are the target's and are not exported: shape-only stand-ins
    drafter = load_drafter(ckpt)
    dcfg = drafter.cfg
    if (dcfg.vocab_size, dcfg.hidden_size) != (tconf.vocab_size, tconf.hidden_size):
        raise UserError(f"{ckpt}: the drafter there was trained for a target of vocabulary {dcfg.vocab_size} and "
                        f"hidden size {dcfg.hidden_size}, {tpath} has {tconf.vocab_size} and {tconf.hidden_size}")
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    # the mask token's text, which SGLang checks against the target's tokenizer (docs/serving.md)
    mask_token = load_tokenizer(cfg.target).convert_ids_to_tokens(dcfg.mask_token_id)

    data = Path(args.data or paths.dataset(cfg.results_dir, cfg.dataset_name))
    summary, acceptance, manifest = stated(folder, ckpt, data)
    with atomic_dir(out, RECORD) as tmp:
        write_drafter(drafter, tmp, dtype=dtype, mask_token=mask_token)
        card = model_card(cfg, tconf, dcfg, ckpt, summary, acceptance, manifest, read_json(tmp / "config.json"))
        (tmp / "README.md").write_text(card)
        for problem in serving_problems(tmp):   # e.g. a target layer id the serving stacks read differently
            log.warning("serving contract (docs/serving.md): %s", problem)
        atomic_write_json(tmp / RECORD, {"checkpoint": str(ckpt), "target": str(tpath), "dtype": args.dtype,
                                         "files": describe_files(tmp, skip={RECORD})})
    log.info("drafter from %s (%d layers, block %d, target layers %s) -> %s", ckpt, dcfg.num_layers,
             dcfg.block_size, dcfg.target_layer_ids, out)
    return 0
