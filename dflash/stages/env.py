"""Stage `env`: check the running environment against envs/ and write results/env/fingerprint.json."""
import logging

from dflash.config import Loaded
from dflash.errors import UserError

log = logging.getLogger("dflash.env")


def add_arguments(p):
    p.add_argument("--out", default=None, help="fingerprint JSON (default: <results_dir>/env/fingerprint.json)")


def run(loaded: Loaded, args) -> int:
    from dflash import fingerprint, paths
    from dflash.atomic import atomic_write_json, check_file_ours

    out = check_file_ours(args.out or paths.fingerprint(loaded.cfg.results_dir), ("hash", "packages"), "env")
    fp = fingerprint.collect()
    problems = fingerprint.pin_mismatches(fp, fingerprint.read_pins())
    fp["pin_mismatches"] = problems
    for line in problems:
        log.warning("environment differs from envs/requirements.txt: %s", line)
    if problems and loaded.cfg.strict_env:
        raise UserError(f"strict_env is on and {len(problems)} package(s) differ from the pins: " + "; ".join(problems))
    atomic_write_json(out, fp)
    gpu = fp["gpu"]
    log.info("environment %s: python %s, torch %s, %s GPU(s) %s -> %s", fp["hash"], fp["python"],
             fp["packages"]["torch"], gpu["count"], ",".join(gpu["models"]) or "", out)
    return 0
