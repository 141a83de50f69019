"""moedoctor's own file writes when the disk may be full: an atomic replace that leaves no partial
temporary file behind, and an in-place rewrite inside the space a file already holds."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

#: The errors of a file system out of space (disk full, quota): an in-place rewrite may still fit.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file, so a reader never sees half of it;
    on OSError the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def rewrite_in_place(path: Path, data: bytes) -> bool:
    """Overwrite ``path`` with ``data`` within the blocks it already holds, which needs no new space
    on a full disk or at a quota (not on copy-on-write file systems, where the write fails); False,
    with nothing written, when ``data`` would not fit. Not atomic: the fallback when a replace fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if len(data) > os.fstat(fd).st_blocks * 512:
            return False
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, data[offset:], offset)
        os.ftruncate(fd, len(data))
        return True
    finally:
        os.close(fd)
