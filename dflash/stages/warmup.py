"""Stage `warmup` (not built yet)."""
from dflash.errors import UserError


def add_arguments(p):
    pass


def run(loaded, args):
    raise UserError("stage 'warmup' is not built yet")
