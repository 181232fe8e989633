"""Workspaces: a fresh private copy of a task's files for one episode, and the user id that owns it.

Layout under ``root_dir`` (mode 0711, owned by this process's user)::

    <id>-<token>/           one episode (0711)
        work/               the task's files; cwd and HOME of every run (0700, owned by the uid)
        tmp/                mounted on /tmp, /var/tmp, /dev/shm inside the sandbox (0700, uid)
    .uids/<id>              lock files: a workspace holds an exclusive ``flock`` on its id's file

Each live workspace holds an id from ``[uid_base, uid_base + num_uids)``, taken by locking
``.uids/<id>`` (works across threads and processes; a crashed process's locks are released by
the kernel). In isolated mode the id is the uid its files belong to and its commands run as: its
processes and threads are what ``RLIMIT_NPROC`` counts, and other workspaces' folders are closed
to it (0700). Unisolated, files belong to this process's user and the id only names the folder.
A folder whose id nobody holds was left by a crashed process: ``IdPool.sweep`` (at ``Sandbox``
start) and taking that id again delete it.

``Workspace.resolve`` is the one place that turns a path from the model into a real path; it
refuses anything whose real path (symlinks resolved) is outside ``work/``.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


class PathOutsideWorkspace(ValueError):
    """A path from the model resolves (symlinks included) to a place outside the workspace."""


class IdPool:
    """Exclusive workspace ids, held as ``flock``s on files under ``<root_dir>/.uids``.

    In isolated mode the id is the workspace's uid; unisolated, it only names and guards the folder.
    """

    def __init__(self, lock_dir: Path, base: int, size: int) -> None:
        self.lock_dir, self.base, self.size = lock_dir, base, size
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        # Each search starts one past where the previous one started, so a busy pool is not
        # rescanned from the base every time; the random origin spreads processes apart.
        self._next = itertools.count(secrets.randbelow(size))

    def try_acquire(self, ident: int) -> int | None:
        """The open lock file holding ``ident`` (close it to release), or ``None`` if it is taken."""
        fd = os.open(self.lock_dir / str(ident), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def acquire(self) -> tuple[int, int]:
        """A free id and the open lock file holding it."""
        start = next(self._next)
        for i in range(self.size):
            ident = self.base + (start + i) % self.size
            fd = self.try_acquire(ident)
            if fd is not None:
                return ident, fd
        raise RuntimeError(
            f"sandbox: all {self.size} workspace ids from {self.base} are in use; "
            "close workspaces you are done with or raise sandbox.num_uids"
        )

    def sweep(self, root_dir: Path) -> int:
        """Delete workspace folders whose id nobody holds (left by a crashed process); how many."""
        removed = 0
        for entry in root_dir.iterdir():
            ident, sep, _ = entry.name.partition("-")
            if not sep or not ident.isdigit() or not entry.is_dir():
                continue
            fd = self.try_acquire(int(ident))
            if fd is None:
                continue
            try:
                _remove_tree(entry)
                removed += 1
            finally:
                os.close(fd)
        return removed


class Workspace:
    """One episode's files: ``path`` (the working folder) and ``tmp``, owned by ``uid`` when isolated.

    Make one with ``Sandbox.workspace(source)``; use it as a context manager, or ``close()`` it,
    which deletes the files and frees the uid.
    """

    def __init__(self, root: Path, uid: int | None, id_lock_fd: int) -> None:
        self.root = root
        self.path = root / "work"
        self.tmp = root / "tmp"
        self.uid = uid
        self._id_lock_fd: int | None = id_lock_fd
        self._at_close: list[Callable[[], None]] = []
        self.closed = False

    @classmethod
    def create(
        cls, root_dir: Path, source: Path | None, pool: IdPool, *, own_uid: bool, disk_mb: int | None = None
    ) -> Workspace:
        """A new workspace under ``root_dir`` holding a copy of ``source`` (an empty one if ``None``).

        With ``own_uid`` (isolated mode) its files belong to the uid it takes from ``pool``. With
        ``disk_mb`` its folder is a tmpfs of that size (needs root): ``work/`` and ``tmp/`` together
        hold at most that much, and a write past it fails with ``ENOSPC``.
        """
        if source is not None and not Path(source).is_dir():
            raise ValueError(f"sandbox: workspace source {str(source)!r} is not a folder")
        ident, fd = pool.acquire()
        uid = ident if own_uid else None
        try:
            for stale in root_dir.glob(f"{ident}-*"):
                _remove_tree(stale)
            root = root_dir / f"{ident}-{secrets.token_hex(6)}"
            root.mkdir(mode=0o711)
            if disk_mb is not None:
                _mount_tmpfs(root, disk_mb)
            workspace = cls(root.resolve(), uid, fd)
            if source is not None:
                try:
                    shutil.copytree(source, workspace.path, symlinks=True)
                except shutil.Error as e:
                    if disk_mb is not None and "No space left on device" in str(e):
                        raise ValueError(
                            f"sandbox: workspace source {str(source)!r} does not fit in "
                            f"sandbox.workspace_disk_mb = {disk_mb} MiB; raise it"
                        ) from None
                    raise
            else:
                workspace.path.mkdir()
            workspace.tmp.mkdir()
            if uid is not None:
                for top in (workspace.path, workspace.tmp):
                    _chown_tree(top, uid)
            for top in (workspace.path, workspace.tmp):
                os.chmod(top, 0o700)
        except BaseException:
            for partial in root_dir.glob(f"{ident}-*"):  # a half-made copy, e.g. the disk is full
                _remove_tree(partial)
            os.close(fd)
            raise
        return workspace

    def resolve(self, path: str) -> Path:
        """The real path of ``path`` (relative to the workspace, or absolute inside it).

        Raises ``PathOutsideWorkspace`` when the path, with every symlink resolved, is not inside.
        """
        candidate = Path(path) if os.path.isabs(path) else self.path / path
        real = Path(os.path.realpath(candidate))
        if real != self.path and self.path not in real.parents:
            raise PathOutsideWorkspace(f"{path!r} is outside the workspace (it resolves to {str(real)!r})")
        return real

    def relative(self, real: Path) -> str:
        """How the model should see a path inside the workspace."""
        rel = real.relative_to(self.path).as_posix()
        return "." if rel == "." else rel

    def give(self, path: Path) -> None:
        """Hand a file or folder this process created inside the workspace to the workspace's uid."""
        if self.uid is not None:
            os.lchown(path, self.uid, self.uid)

    def at_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the workspace closes, before its files go and its uid is freed
        (``sandbox/server.py``: a process kept running in the workspace is stopped there)."""
        self._at_close.append(callback)

    def close(self) -> None:
        """Stop what ``at_close`` registered, delete the workspace's files and free its uid."""
        if self.closed:
            return
        self.closed = True
        for callback in self._at_close:
            try:
                callback()
            except Exception:
                logger.exception("sandbox: a close callback of workspace %s failed", self.root.name)
        _remove_tree(self.root)
        if self._id_lock_fd is not None:
            os.close(self._id_lock_fd)
            self._id_lock_fd = None

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace({str(self.path)!r}, uid={self.uid})"


def _chown_tree(top: Path, uid: int) -> None:
    os.lchown(top, uid, uid)
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, uid)


def _libc():  # type: ignore[no-untyped-def]
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    import ctypes

    ms_nosuid, ms_nodev = 2, 4
    options = f"size={size_mb}m,mode=0711".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", ms_nosuid | ms_nodev, options) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: cannot mount the workspace's tmpfs on {path}: {os.strerror(errno)}")


def _unmount(path: Path) -> None:
    import ctypes

    if _libc().umount2(str(path).encode(), 2) != 0:  # MNT_DETACH: freed once nothing uses it
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: cannot unmount {path}: {os.strerror(errno)}")


def _remove_tree(path: Path) -> None:
    """Delete ``path`` (unmounting it if it is a workspace's tmpfs), also when sandboxed code left
    folders without permissions in it."""
    if not path.exists():
        return
    if os.path.ismount(path):
        _unmount(path)
    if os.geteuid() != 0:  # root needs no permission bits; anyone else restores them on the way down
        os.chmod(path, stat.S_IRWXU)
        for folder, dirs, _ in os.walk(path):
            for name in dirs:
                child = os.path.join(folder, name)
                if not os.path.islink(child):
                    os.chmod(child, stat.S_IRWXU)
    shutil.rmtree(path)
