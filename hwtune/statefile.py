"""State files (STATE_DIR: journal, lock, locks.json, markers): hwtune runs as root, so no
other user may steer what it writes or what it trusts.

- The state directory is created 0700 (whatever the umask: mkdir's mode only loses bits);
  an existing one must be ours (or root's) and writable by nobody else, and is never
  chmod-ed (`--state-dir /tmp` must not change /tmp); a symbolic link in its place is refused.
- A file is replaced through a temporary file that `mkstemp` makes inside that directory
  (O_CREAT | O_EXCL | O_NOFOLLOW, a random name, so a planted link is never followed), given
  its mode explicitly (0600), fsynced, renamed over the target, and the directory fsynced.
  A failed write leaves no temporary file behind.
- A file is read with O_NOFOLLOW and refused when it is not a regular file, is owned by
  another user, or is writable by group or others.
- A full disk is one line (StateWriteError), never a raw OSError. `reserve` sets space aside
  before a write sequence starts; a write that meets ENOSPC frees that reserve and retries
  once, so an apply can always finish or undo its journal.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from hwtune import faults
from hwtune.errors import HwtuneError

DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_STATE_BYTES = 16 << 20  # no state file is near this; a bigger one is not ours
RESERVE_PREFIX = ".reserve."

_reserves: dict = {}  # directory -> path of its reserve file


class StateError(HwtuneError):
    """A state file or directory hwtune must not trust or cannot use."""


class StateDirError(StateError):
    """A state directory that cannot be made or must not be used: bad input, nothing written."""

    exit_code = 2


class StateWriteError(StateError):
    def __init__(self, message: str, errno_: int | None = None):
        self.errno = errno_
        super().__init__(message)


def _owner_ok(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on device"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded"
    return exc.strerror or str(exc)


def ensure_dir(path) -> Path:
    """Create the state directory (0700) or check an existing one; returns it."""
    path = Path(path)
    for parent in reversed(path.parents):
        if not parent.exists():
            try:
                os.mkdir(parent, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                raise StateDirError(f"state directory {path}: cannot create {parent}: {_why(exc)}") from None
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateDirError(f"state directory {path}: cannot create: {_why(exc)}") from None
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StateDirError(f"state directory {path}: not a directory (a symbolic link or a file); "
                             "refusing to use it") from None
        raise StateDirError(f"state directory {path}: {_why(exc)}") from None
    try:
        st = os.fstat(fd)
        if not _owner_ok(st.st_uid):
            raise StateDirError(f"state directory {path}: owned by uid {st.st_uid}, not by this user or root; "
                             "refusing to use it")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StateDirError(f"state directory {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
                             f"write in it; refusing to use it (chmod 0700 {path}, or choose another --state-dir)")
    finally:
        os.close(fd)
    return path


def fsync_dir(path) -> None:
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_once(path: Path, payload: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            faults.hit(f"state.write:{path.name}")
            view = memoryview(payload)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_bytes(path, payload: bytes, mode: int = FILE_MODE) -> None:
    """Atomic, durable replace of `path` (see the module docstring)."""
    path = Path(path)
    try:
        try:
            _write_once(path, payload, mode)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not release(path.parent):
                raise
            _write_once(path, payload, mode)
    except OSError as exc:
        raise StateWriteError(f"cannot write {path}: {_why(exc)}", exc.errno) from None


def write_json(path, data, mode: int = FILE_MODE) -> None:
    write_bytes(path, (json.dumps(data, indent=2) + "\n").encode(), mode)


def read_bytes(path, what: str = "state file") -> bytes | None:
    """The file's bytes, or None when it does not exist. Refuses a link, a non-regular file,
    one owned by another user, or one that group or others may write."""
    path = Path(path)
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateError(f"{what} {path}: a symbolic link; refusing to read it") from None
        raise StateError(f"{what} {path}: cannot read: {_why(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{what} {path}: not a regular file; refusing to read it")
        if not _owner_ok(st.st_uid):
            raise StateError(f"{what} {path}: owned by uid {st.st_uid}, not by this user or root; "
                             "refusing to trust it (inspect it, then remove it)")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StateError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users write it; "
                             "refusing to trust it (inspect it, then remove it)")
        if st.st_size > MAX_STATE_BYTES:
            raise StateError(f"{what} {path}: {st.st_size} bytes, not a hwtune state file")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise StateError(f"{what} {path}: cannot read: {_why(exc)}") from None
    finally:
        os.close(fd)


def read_json(path, what: str = "state file"):
    """Parsed JSON of a trusted state file, None when missing; StateError when unreadable."""
    raw = read_bytes(path, what)
    if raw is None:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateError(f"{what} {path}: unreadable ({type(exc).__name__})") from None


def open_lock_file(path) -> int:
    """The lock file's descriptor: never through a link, never a file of another user, 0600."""
    path = Path(path)
    try:
        fd = os.open(str(path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateError(f"lock {path}: a symbolic link; refusing to open it") from None
        raise StateError(f"lock {path}: cannot open: {_why(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise StateError(f"lock {path}: not a plain file (or hard-linked); refusing to use it")
        if not _owner_ok(st.st_uid):
            raise StateError(f"lock {path}: owned by uid {st.st_uid}; refusing to use it")
        if stat.S_IMODE(st.st_mode) != FILE_MODE and st.st_uid == os.geteuid():
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reserve(directory, nbytes: int) -> None:
    """Set `nbytes` aside in `directory` (a preallocated hidden file), or raise StateWriteError
    saying the disk is too full: checked before the first hardware write."""
    directory = Path(directory)
    release(directory)
    try:
        fd, tmp = tempfile.mkstemp(dir=str(directory), prefix=RESERVE_PREFIX)
    except OSError as exc:
        raise StateWriteError(f"{directory}: cannot set space aside for the journal: {_why(exc)}",
                              exc.errno) from None
    try:
        faults.hit("state.reserve")
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, b"\0" * nbytes)  # a filesystem without fallocate: write it
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(tmp)
        raise StateWriteError(f"{directory}: {_why(exc)}: not even {nbytes} bytes free for the journal; "
                              "nothing was written", exc.errno) from None
    os.close(fd)
    _reserves[str(directory)] = tmp


def release(directory) -> bool:
    """Free the reserve of `directory`; True when there was one."""
    tmp = _reserves.pop(str(Path(directory)), None)
    if tmp is None:
        return False
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return True


def clean_leftovers(directory, names: tuple, reserves: bool = True) -> None:
    """Remove temporary files a killed writer of `names` left in `directory`, and reserve
    files when `reserves` (only with the writer lock held: a live apply owns its reserve)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    mine = set(_reserves.values())
    for entry in entries:
        full = os.path.join(directory, entry)
        stale = (reserves and entry.startswith(RESERVE_PREFIX)) or any(
            entry.startswith(f".{n}.") and entry.endswith(".tmp") for n in names)
        if not stale or full in mine:
            continue
        try:
            if os.lstat(full).st_uid == os.geteuid():
                os.unlink(full)
        except OSError:
            pass
