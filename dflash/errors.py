"""Errors that are the user's to fix: reported as one clear line and a non-zero exit, without a traceback."""


class UserError(RuntimeError):
    """Bad input (a file, a row, a key): the message names it."""
