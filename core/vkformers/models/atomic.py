"""Writing files safely: atomically (a crash leaves the old file or the new one, never half), and never
through a symbolic link, so that a link planted in an output folder cannot redirect a write to a file
elsewhere (a write replaces or appends to the folder's own entry, or is refused).
"""
from __future__ import annotations

import errno
import json
import os
import stat
from contextlib import contextmanager, suppress
from pathlib import Path

from vkformers.errors import OutputFolderError, UnsafePathError

# O_NOFOLLOW makes open() fail (ELOOP) on a link instead of opening its target; Windows has no such flag
# (nor, without privileges, symbolic links), so there the lstat checks below stand alone.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _link_message(path: Path) -> str:
    return (f"{path} is a symbolic link; vkformers does not write through links (the write would land in "
            "another file than the one in the output folder): remove the link or choose another output folder")


def refuse_symlink(path) -> Path:
    """``path`` if it is not a symbolic link (it may not exist); :class:`UnsafePathError` if it is one."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafePathError(_link_message(path))
    return path


def refuse_symlinks_below(root, path) -> Path:
    """``path`` if no component of it below ``root`` is a symbolic link (``root`` itself may be one: the
    user chose it). For files inside subfolders of an output folder, e.g. ``out/final/tokenizer.json``."""
    root, path = Path(root), Path(path)
    current = root
    for part in path.relative_to(root).parts:
        current = refuse_symlink(current / part)
    return path


def make_folder(path) -> Path:
    """``mkdir -p`` that refuses a symbolic link at ``path`` (a link to a folder would pass exist_ok)."""
    path = refuse_symlink(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputFolderError(f"cannot create the folder {path} ({exc.strerror}): choose another output "
                                "folder") from None
    return path


def _open_fd(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | NOFOLLOW | CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and path.is_symlink()):
            raise UnsafePathError(_link_message(path)) from None
        raise


def open_for_append(path, mode: str = "a"):
    """Open ``path`` to append (created if missing) without following a link at it; refuses a file that is
    not a regular file or has other hard links (appending would change a file outside the folder)."""
    path = refuse_symlink(path)
    fd = _open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = "has other hard links" if stat.S_ISREG(info.st_mode) else "is not a regular file"
        raise UnsafePathError(f"{path} {what}; vkformers appends only to files of its own: remove it or choose "
                              "another output folder")
    return os.fdopen(fd, mode)


@contextmanager
def atomic_write(path, mode: str = "w"):
    """A file object for ``mode`` ("w" or "wb") that becomes ``path`` when the block ends without an error:
    written to ``<path>.tmp`` (created afresh, never through a link), fsynced, then renamed over ``path``.
    On an error (a full disk, say) the temporary file is removed and ``path`` is left as it was."""
    path = refuse_symlink(path)
    tmp = path.with_name(path.name + ".tmp")
    with suppress(FileNotFoundError):  # left by a killed writer; unlinking a link removes only the link
        os.unlink(tmp)
    fd = _open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        refuse_symlink(path)  # a link planted while writing
        os.replace(tmp, path)  # renames over the entry itself: never writes into a link's target
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write() names no file: say which
            exc.filename = str(path)
        raise


def write_bytes_atomic(path, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def write_text_atomic(path, text: str) -> None:
    """Write to a temporary name beside ``path``, fsync, then rename over it."""
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json_atomic(path, data) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
