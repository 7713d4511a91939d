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


# OSErrors that are the user's to fix, and what to do: a full disk (ENOSPC) has its own line (disk_full)
_FIXES = {
    "EACCES": ("permission denied", "make it {how} for this user, or give another path"),
    "EPERM": ("operation not permitted", "make it {how} for this user, or give another path"),
    "EROFS": ("on a read-only file system", "give a path on a writable disk"),
    "EISDIR": ("a folder, where a file is expected", "give the path of a file"),
    "ENOTDIR": ("a file, where a folder is expected (the path or one of its parents)", "give another path"),
    "EEXIST": ("a file is in the way of a folder there", "move it away, or give another path"),
    "ENOENT": ("no such file or folder", "check the path"),
}


def io_error(e: BaseException | None, path=None, action: str | None = None) -> UserError | None:
    """One line for an OSError in `e`'s chain that the user fixes (permissions, a read-only disk, a folder where a file
    belongs or the reverse), naming `path` (else the file the error names) and what to do; None for any other error.
    `action`: "read" or "write", what was being done to the path; None: told from the error (`_action`). Every
    message of a file or folder that cannot be read or written is worded here."""
    import errno
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno is not None and errno.errorcode.get(e.errno) in _FIXES:
            what, fix = _FIXES[errno.errorcode[e.errno]]
            where = path if path is not None else (e.filename or "a file")
            action = action or _action(e)
            how = "readable" if action == "read" else "writable"
            return UserError(f"{where}: cannot {action} it: {what}; {fix.format(how=how)}")
        e = e.__cause__ or e.__context__
    return None


def _action(e: OSError) -> str:
    """What an OSError refused, where the code that met it did not say: a permission refused on one file or folder
    that exists is a read of it (outputs are written into new temporary files, then renamed, so a write names a path
    not yet there, or two); anything else is a write."""
    import errno
    import os
    return "read" if (e.errno in (errno.EACCES, errno.EPERM) and e.filename and not e.filename2
                      and os.path.lexists(e.filename)) else "write"
