"""Workspaces: a fresh private copy of a task's files for one episode, and the user id that owns it.

Layout under ``root_dir`` (mode 0711, owned by this process's user)::

    <uid>-<token>/          one episode (0711)
        work/               the task's files; cwd and HOME of every run (0700, owned by uid)
        tmp/                mounted on /tmp, /var/tmp, /dev/shm inside the sandbox (0700, uid)
    .uids/<uid>             lock files: a workspace holds an exclusive ``flock`` on its uid's file

In isolated mode each live workspace has its own user id from ``[uid_base, uid_base + num_uids)``,
taken by locking ``.uids/<uid>`` (works across threads and processes; a crashed process's locks
are released by the kernel). Its processes and threads are what ``RLIMIT_NPROC`` counts, and
other workspaces' folders are closed to it (0700). When a uid is taken, folders left under it by
a crashed process are deleted first. In unisolated mode files belong to this process's user.

``Workspace.resolve`` is the one place that turns a path from the model into a real path; it
refuses anything whose real path (symlinks resolved) is outside ``work/``.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import secrets
import shutil
import stat
from pathlib import Path


class PathOutsideWorkspace(ValueError):
    """A path from the model resolves (symlinks included) to a place outside the workspace."""


class UidPool:
    """Exclusive user ids for workspaces, held as ``flock``s on files under ``<root_dir>/.uids``."""

    def __init__(self, lock_dir: Path, base: int, size: int) -> None:
        self.lock_dir, self.base, self.size = lock_dir, base, size
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        # Start each search where the last one ended, so a busy pool is not rescanned from base.
        self._next = itertools.count(secrets.randbelow(size))

    def acquire(self) -> tuple[int, int]:
        """A free uid and the open lock file holding it (close the fd to release it)."""
        start = next(self._next)
        for i in range(self.size):
            uid = self.base + (start + i) % self.size
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return uid, fd
        raise RuntimeError(
            f"sandbox: all {self.size} workspace user ids from {self.base} are in use; "
            "close workspaces you are done with or raise sandbox.num_uids"
        )


class Workspace:
    """One episode's files: ``path`` (the working folder) and ``tmp``, owned by ``uid`` when isolated.

    Make one with ``Sandbox.workspace(source)``; use it as a context manager, or ``close()`` it,
    which deletes the files and frees the uid.
    """

    def __init__(self, root: Path, uid: int | None, uid_lock_fd: int | None) -> None:
        self.root = root
        self.path = root / "work"
        self.tmp = root / "tmp"
        self.uid = uid
        self._uid_lock_fd = uid_lock_fd
        self.closed = False

    @classmethod
    def create(cls, root_dir: Path, source: Path | None, pool: UidPool | None) -> Workspace:
        """A new workspace under ``root_dir`` holding a copy of ``source`` (an empty one if ``None``)."""
        if source is not None and not Path(source).is_dir():
            raise ValueError(f"sandbox: workspace source {str(source)!r} is not a folder")
        uid, fd = pool.acquire() if pool is not None else (None, None)
        try:
            if uid is not None:
                for stale in root_dir.glob(f"{uid}-*"):
                    _remove_tree(stale)
            root = root_dir / f"{uid if uid is not None else 'ws'}-{secrets.token_hex(6)}"
            root.mkdir(mode=0o711)
            workspace = cls(root.resolve(), uid, fd)
            if source is not None:
                shutil.copytree(source, workspace.path, symlinks=True)
            else:
                workspace.path.mkdir()
            workspace.tmp.mkdir()
            if uid is not None:
                for top in (workspace.path, workspace.tmp):
                    _chown_tree(top, uid)
            for top in (workspace.path, workspace.tmp):
                os.chmod(top, 0o700)
        except BaseException:
            if fd is not None:
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

    def close(self) -> None:
        """Delete the workspace's files and free its uid."""
        if self.closed:
            return
        self.closed = True
        _remove_tree(self.root)
        if self._uid_lock_fd is not None:
            os.close(self._uid_lock_fd)
            self._uid_lock_fd = None

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


def _remove_tree(path: Path) -> None:
    """Delete ``path``, also when sandboxed code left folders without permissions in it."""
    if not path.exists():
        return
    if os.geteuid() != 0:  # root needs no permission bits; anyone else restores them on the way down
        os.chmod(path, stat.S_IRWXU)
        for folder, dirs, _ in os.walk(path):
            for name in dirs:
                child = os.path.join(folder, name)
                if not os.path.islink(child):
                    os.chmod(child, stat.S_IRWXU)
    shutil.rmtree(path)
