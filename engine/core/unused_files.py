"""Files kept in the cache folder across starts that may outlive their use: the quantized
weights of an earlier layout or torch, the KV snapshot of an entry since removed. A file's
modification time records its last use (`mark_used` on every read), and one unused for
`UNUSED_FOR_S` may be removed by whoever finds it: servers on one host share these folders,
so no server can tell another's files from stale ones, and a removed file is only computed
again by whoever needs it next (one still open stays readable to its reader: the inode
lives on)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

UNUSED_FOR_S = 7 * 24 * 3600.0  # a week


def mark_used(path: Path) -> None:
    """`path` was just read. A read-only folder keeps its files' times (nothing is removed
    there either)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def remove_if_unused(path: Path) -> bool:
    """Remove `path` if unused for UNUSED_FOR_S (logged); False when it was used since, or
    is gone already, or cannot be removed."""
    try:
        stat = path.stat()
        if stat.st_mtime >= time.time() - UNUSED_FOR_S:
            return False
        path.unlink()
    except OSError:  # gone already (another server removed it), or not ours to remove
        return False
    logger.info(
        "removed %s (%.1f MB), unused for %.0f days",
        path,
        stat.st_size / 1e6,
        (time.time() - stat.st_mtime) / 86400,
    )
    return True
