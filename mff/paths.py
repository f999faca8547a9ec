"""Describing paths in error messages."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["file_kind"]


def file_kind(path: str | os.PathLike) -> str:
    """What ``path`` is, for an error saying it is not the regular file expected: ``a folder``,
    ``a FIFO (named pipe)``, ``a socket``, ``a character device``, ``a block device``, ``a regular
    file``, ``missing`` (it does not exist), ``a broken symlink``, ``a symlink loop`` or ``unreadable (reason)``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symlink" if os.path.islink(path) else "missing"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        return f"unreadable ({os.strerror(e.errno) if e.errno else e})"
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"
