"""`python -m dflash <stage> --config CONFIG ...`: one subcommand per pipeline stage."""
from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import signal
import sys

from dflash.config import ConfigError, check_here, load, parse_value
from dflash.errors import UserError, disk_full, io_error, written_path

# stage name -> one-line help; the module is dflash.stages.<name> (dashes become underscores).
STAGES = {
    "env": "check the environment against envs/ pins and write the fingerprint",
    "target": "build the embedded tiny target (or a random-weight benchmark target)",
    "data": "expand sources into tokenised, length-bucketed Arrow shards with a manifest",
    "warmup": "compile the drafter's attention for every length bucket on one device",
    "train": "train the drafter (threads or distributed runtime)",
    "evaluate": "speculative decoding with the target: acceptance length tau, losslessness",
    "export": "write the drafter in the reference inference format with a model card",
    "report": "throughput history, regressions with attribution, plots and report.md",
    "gate": "exit non-zero when report.fail_on_regression is set and the newest run regressed",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, help_text in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", required=True, help="pipeline YAML (its keys: dflash/config_model.py)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=10 (repeatable)")
        p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        p.add_argument("--log", default=None, metavar="FILE",
                       help="also write the log (and any traceback) to FILE; the console keeps it and progress bars")
        module = importlib.import_module(f"dflash.stages.{name}")
        module.add_arguments(p)
    p = sub.add_parser("schema", help=SCHEMA_HELP, description=SCHEMA_HELP)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write it to {SCHEMA_FILE}")
    what.add_argument("--check", action="store_true", help=f"exit 1 when {SCHEMA_FILE} differs from the models")
    return parser


SCHEMA_FILE = "workflow/schemas/config.schema.yaml"
SCHEMA_HELP = f"print the config's JSON schema generated from dflash/config_model.py (--write: into {SCHEMA_FILE})"


def schema(args) -> int:
    """`dflash schema`: the generated schema on stdout, written atomically to its file, or checked against it."""
    from dflash.atomic import atomic_write_text
    from dflash.config import SCHEMA_PATH, schema_text
    text = schema_text()
    if args.write:
        atomic_write_text(SCHEMA_PATH, text)
    elif args.check:
        if not SCHEMA_PATH.is_file() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_FILE} differs from dflash/config_model.py: run `python -m dflash schema --write`",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(args) -> logging.Handler | None:
    """Log lines to the console (stderr) and, with --log, to that file too; returns the file's handler. Progress
    bars are for a terminal: on a pipe or a file they are off and the stages' periodic log lines show progress."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=FORMAT, datefmt="%H:%M:%S")
    logging.captureWarnings(True)
    if hasattr(args, "no_progress") and not sys.stderr.isatty():
        args.no_progress = True
    if not args.log:
        return None
    from pathlib import Path
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(args.log, mode="w")
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    logging.getLogger().addHandler(handler)
    return handler


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stage == "schema":
        return schema(args)
    handler = setup_logging(args)
    dumps = _stack_dumps(handler)
    try:
        return _run(args)
    finally:
        if dumps:
            faulthandler.unregister(signal.SIGUSR2)
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _stack_dumps(handler: logging.Handler | None) -> bool:
    """`kill -USR2 <pid>` of a stage that seems stuck writes every thread's Python stack into its --log file (else to
    stderr), and the stage runs on: no debugger or py-spy needed (SIGUSR1 is `train`'s stop-and-checkpoint). Returns
    whether it is registered (main unregisters it when the stage ends)."""
    if not hasattr(signal, "SIGUSR2"):
        return False
    file = handler.stream if isinstance(handler, logging.FileHandler) and handler.stream else sys.__stderr__
    try:
        file.fileno()                      # a replaced sys.stderr (pytest's capture, a notebook) has none
    except (AttributeError, OSError, ValueError):
        return False
    faulthandler.register(signal.SIGUSR2, file=file, all_threads=True)
    return True


def _run(args) -> int:
    loaded = None
    try:
        overrides = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item}: expected KEY=VALUE")
            overrides[key] = parse_value(value, f"--set {item}")
        loaded = load(args.config, overrides)
        # what this machine must have for the keys this stage reads (a CUDA GPU); a warm-up job compiles for its one
        # --device and names its own remedy (a cluster job sees its GPUs renumbered from 0)
        check_here(loaded, args.stage, devices=args.stage != "warmup")
        module = importlib.import_module(f"dflash.stages.{args.stage}")
        return int(module.run(loaded, args) or 0)
    except KeyboardInterrupt:        # Ctrl-C (train checkpoints first and ends itself, with the same code)
        return _fail(args, f"dflash {args.stage}: interrupted (Ctrl-C); every output is written whole or not at all, "
                           f"so rerun to do it again", 130)
    except ConfigError as e:
        return _fail(args, f"dflash {args.stage}: config error: {e}", 2)
    except UserError as e:
        return _fail(args, f"dflash {args.stage}: error: {e}", 1)
    except Exception as e:
        if disk_full(e):
            results = loaded.cfg.results_dir if loaded is not None else "the results folder"
            return _fail(args, f"dflash {args.stage}: error: {_no_space(args, e, results)}", 1)
        # permissions, a read-only disk, a folder where a file belongs (or the reverse): one line, naming the path
        # refused (or the nearest folder that exists) and what to do
        if (fix := io_error(e, _denied_path(e) if _denied(e) else None)) is not None:
            return _fail(args, f"dflash {args.stage}: error: {fix}", 1)
        if args.log:  # the traceback goes to the log file as well as to the console
            logging.getLogger(f"dflash.{args.stage}").exception("dflash %s failed", args.stage)
            return 1
        raise


def _denied(e: Exception) -> bool:
    """A path this process may not write or read (a write-protected folder, a read-only file system), named."""
    import errno
    return isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and bool(e.filename)


def _denied_path(e: OSError):
    """The path refused: the file, or where it could not be made (an atomic write's temporary file, a folder) the
    nearest folder that exists."""
    from pathlib import Path
    p = Path(e.filename)
    return next((q for q in (p, *p.parents) if q.exists()), p)


def _no_space(args, e: Exception, results: str) -> str:
    """A full disk in one line: where (the file being written, else the stage's output, else the results folder),
    the space left there, the remedy."""
    import shutil
    from pathlib import Path
    where = written_path(e) or getattr(args, "out", None) or getattr(args, "run_dir", None) or results
    p = Path(where).absolute()
    near = next((d for d in (p, *p.parents) if d.exists()), Path.cwd())
    free = shutil.disk_usage(near).free / 2**20
    return (f"no space left on device while writing {where} ({free:.0f} MiB free there now): free space on that disk "
            f"(or set results_dir to another one) and rerun; every output is written whole or not at all, so none is "
            f"left half-written")


def _fail(args, line: str, code: int) -> int:
    """One line on the console (no traceback), the same line in the --log file."""
    print(line, file=sys.stderr)
    if args.log:
        try:
            with open(args.log, "a") as f:
                f.write(line + "\n")
        except OSError:   # e.g. the full disk the line is about: the console has it
            pass
    return code

