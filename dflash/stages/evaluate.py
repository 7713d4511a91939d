"""Stage `evaluate` (not built yet)."""
from dflash.errors import UserError


def add_arguments(p):
    pass


def run(loaded, args):
    raise UserError("stage 'evaluate' is not built yet")
