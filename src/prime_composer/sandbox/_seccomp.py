"""The seccomp filter of sandboxed commands: no new namespaces, and none of the kernel's riskier calls.

Built once by the fork server (``_init.py``; stdlib only) through the system's libseccomp
(``libseccomp.so.2``, by ctypes) and loaded by each command's process right before ``exec``,
after it dropped to the workspace's uid and set ``no_new_privs``; everything the command starts
inherits it. The default action is to allow; these fail with ``EPERM``:

- ``clone`` and ``unshare`` with any namespace flag, and ``setns``: user namespaces would give the
  command root inside one (and a tmpfs it can mount), which is kernel attack surface it never needs;
- ``clone3`` fails with ``ENOSYS`` instead: its flags live in memory, which a seccomp filter cannot
  read, and on ``ENOSYS`` the C library falls back to ``clone``, which the filter can;
- mounting (``mount``, the new mount API, ``umount2``, ``pivot_root``, ``chroot``), tracing and
  reading other processes (``ptrace``, ``process_vm_readv/writev``, ``kcmp``), ``bpf``,
  ``perf_event_open``, the key store (``keyctl``, ``add_key``, ``request_key``), ``userfaultfd``,
  ``io_uring`` (its operations bypass the filter), modules, ``kexec``, swap, reboot, accounting,
  quotas, ``open_by_handle_at``, ``personality`` and ``iopl``/``ioperm``.

A system call of another ABI (i386 ``int 0x80``, x32) kills the process: that is libseccomp's
action for a foreign architecture, so the 32-bit numbers cannot be used to get around the list.
"""

import ctypes
import errno

NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

DENIED = (
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "personality",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "vm86",
    "vm86old",
)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class Filter:
    """The filter, compiled in libseccomp's context; ``load`` applies it to the calling thread."""

    def __init__(self, library: str = "libseccomp.so.2") -> None:
        lib = ctypes.CDLL(library)  # OSError when it is missing
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
        if not self._ctx:
            raise OSError("seccomp_init failed")
        for name in DENIED:
            self._add(name, _errno_action(errno.EPERM))
        self._add("clone3", _errno_action(errno.ENOSYS))
        for flag in NAMESPACE_FLAGS:
            for name in ("clone", "unshare"):
                self._add(name, _errno_action(errno.EPERM), _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))

    def _add(self, name: str, action: int, *compare: _ArgCmp) -> None:
        number = self._lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call of this architecture
            return
        array = (_ArgCmp * len(compare))(*compare) if compare else None
        result = self._lib.seccomp_rule_add_array(self._ctx, action, number, len(compare), array)
        if result < 0:
            raise OSError(-result, f"seccomp rule for {name}: {errno.errorcode.get(-result, result)}")

    def load(self) -> None:
        result = self._lib.seccomp_load(self._ctx)
        if result < 0:
            raise OSError(-result, f"seccomp_load: {errno.errorcode.get(-result, result)}")
