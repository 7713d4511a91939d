"""Stage `target`: build the embedded tiny target (`build: tiny`), the code target pre-trained on Python source
(`build: code`) or a random-weight benchmark target's config and tokenizer (`build: random`) into target.path,
atomically. `build: none` has nothing to build."""
import json
import logging

from dflash.config import Loaded
from dflash.errors import UserError

log = logging.getLogger("dflash.target")


def add_arguments(p):
    p.add_argument("--out", default=None, help="target folder (default: target.path)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for pre-training (default 1: fastest on a shared small machine; 0 leaves torch's)")


RECORD = "build.json"   # dflash.target.BUILD: written by the builders into every target folder they make, listing its files


def check_out(out, results_dir) -> None:
    """Where the target stage may build: inside results_dir or the repository, never over a folder it did not make (a
    model the user points at is an input: build none), nor over one holding files it did not write (build.json lists
    its own). Checked by the stage and by the Snakefile when it is read, before Snakemake removes the rule's output."""
    from dflash.atomic import check_ours
    from dflash.config import REPO, ConfigError, inside
    try:
        check_ours(out, RECORD, "to use that model as it is set target.build: none (it is then an input); to build a "
                                "target, point target.path at a new folder")
    except UserError as e:
        raise UserError(f"target.path: {e}") from None
    try:
        inside(out, results_dir, REPO)
    except ConfigError as e:
        raise ConfigError(f"target.path: {e}: the target stage builds only there (a model folder elsewhere is used "
                          f"with target.build: none)") from None


def run(loaded: Loaded, args) -> int:
    from dflash.atomic import atomic_dir
    from dflash.data.code_target import build_code_target
    from dflash.data.tiny_target import build_target

    cfg = loaded.cfg
    if cfg.target.build == "none":
        raise UserError(f"target.build is none: nothing to build; point target.path ({cfg.target.path}) at a model folder")
    out = args.out or cfg.target.path
    check_out(out, cfg.results_dir)
    with atomic_dir(out, RECORD) as tmp:
        if cfg.target.build == "code":
            info = build_code_target(cfg.target, tmp, seed=cfg.seed, progress=not args.no_progress,
                                     threads=args.threads)
        else:
            info = build_target(cfg.target, tmp, seed=cfg.seed, corpus_size=cfg.data.builtin_corpus.max_conversations,
                                progress=not args.no_progress, threads=args.threads)
    if cfg.target.build == "code":
        log.info("target code: %d params, %d files, held-out perplexity %s, %.1fs -> %s", info["params"],
                 info["corpus"]["files"], info["heldout"]["perplexity"], info["seconds"], out)
        return 0
    pre = info.get("pretrain") or {}
    log.info("target %s (%s): tokenizer %d tokens%s, %.1fs -> %s", cfg.target.build, json.dumps(info["corpus"]),
             info["tokenizer"]["size"],
             f", {info['params']} params, loss {pre.get('loss_start')} -> {pre.get('loss_end')}" if pre else "",
             info["seconds"], out)
    return 0
