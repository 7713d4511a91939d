"""Stage `target` (not built yet)."""
from dflash.errors import UserError


def add_arguments(p):
    pass


def run(loaded, args):
    raise UserError("stage 'target' is not built yet")
