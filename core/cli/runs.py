"""Where a run lives, and who owns it.

``run_folder``: ``out``, else ``runs/<recipe>-<name>``, else ``runs/<recipe>-<timestamp>``; a ``name`` is one
plain path component, so a run never writes outside ``runs/``. ``claim``: an OS-level lock on the run
folder for as long as a run writes into it (``fcntl.flock`` on ``<folder>/.lock``: the kernel drops it when
the process dies, so a ``kill -9`` leaves no stale lock). A second run on the same folder stops with one
line naming the holder. Such locks are unreliable on some network filesystems (NFS without lock support).
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Iterator

from purestep.core.config import ConfigError, UserError
from purestep.core.io.cache import refuse_link

LOCK = ".lock"


class RunFolderLocked(UserError):
    """Another live process holds the run folder's lock."""


def check_name(key: str, value: str) -> str:
    """``value`` if it is one plain path component (no separator, not ``.`` or ``..``), else a ConfigError."""
    if value in (".", "..") or any(sep in value for sep in ("/", "\\", os.sep)) or "\0" in value:
        raise ConfigError(f"{key}={value!r} must be a plain name (no '/', '..'); use out=PATH for a folder elsewhere")
    return value


def run_folder(out: str, name: str, recipe: str) -> Path:
    if out:
        return Path(out)
    check_name("name", name)
    return Path("runs") / f"{recipe}-{name or datetime.now().strftime('%Y%m%d-%H%M%S')}"


def make_folder(folder: Path) -> Path:
    """Create the run folder ``folder`` (and its parents) if needed; a UserError naming it and the reason when
    that cannot be done (no permission, a read-only disk, a file in the way, a virtual filesystem such as
    ``/proc`` that takes no new folders), not the OS's bare ``[Errno N]`` line."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = (e.strerror or os.strerror(e.errno or 0)).lower()
        if e.errno == errno.ENOENT:       # the parents exist, yet mkdir says they do not: /proc, /sys ...
            here = next((p for p in folder.parents if p.is_dir()), None)
            reason = f"{here} takes no new folders ({reason})" if here is not None else reason
        elif e.filename is not None and Path(e.filename) != folder:
            reason = f"{e.filename}: {reason}"
        raise UserError(f"cannot create the run folder {folder}: {reason}; choose another out=") from None
    return folder


def holder(folder: Path) -> str | None:
    """Who holds ``folder``'s run lock (the holder's "pid N on host H" line), or None when no live process does;
    creates nothing (a folder without ``.lock`` is held by no run)."""
    try:
        fd = os.open(Path(folder) / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        return None
    finally:
        os.close(fd)


@contextmanager
def claim(folder: Path) -> Iterator[Path]:
    """Create ``folder`` if needed (``make_folder``) and hold its lock until the block ends; RunFolderLocked if
    another process holds it (the message names that process's pid and host)."""
    folder = make_folder(folder)
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)   # its pid line truncates it
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(folder / LOCK)
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise RunFolderLocked(f"out={folder} is in use by another run ({holder}); wait for it to finish, or "
                                  f"choose another out= (or name=)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield folder
    finally:
        os.close(fd)                                    # closing the descriptor releases the lock
