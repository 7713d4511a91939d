"""Errors that are the user's to fix: reported as one clear line and a non-zero exit, without a traceback."""


class UserError(RuntimeError):
    """Bad input (a file, a row, a key): the message names it."""


def disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or what it was raised from, is a full disk (ENOSPC). torch.save's RuntimeError, datasets'
    DatasetGenerationError and safetensors' Rust writer hide the OSError in their chain or their message."""
    import errno
    for _ in range(8):
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e) or "os error 28" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def written_path(e: BaseException | None) -> str | None:
    """The file an OSError in `e`'s chain names, if any (a write() that hits a full disk names none)."""
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
        e = e.__cause__ or e.__context__
    return None
