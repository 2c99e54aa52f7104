"""The sandbox's seccomp filter, compiled to BPF by libseccomp, for bubblewrap's `--seccomp FD` to load.

The filter allows every system call except:

- always (EPERM): the namespace family (`unshare`, `setns`, `clone` with any `CLONE_NEW*` flag), the mount
  family (`mount`, `umount2`, `pivot_root`, `chroot`, the new mount API), `ptrace` and cross-process memory
  access (`process_vm_readv/writev`, `pidfd_getfd`, `kcmp`), and kernel attack surface no coding task needs
  (`bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*`, keyrings, modules, `kexec`, `reboot`, `swapon`,
  `open_by_handle_at`, `acct`, `syslog`, `quotactl`);
- with `max_processes=0` (EPERM): process creation, i.e. `fork`, `vfork` and `clone` without `CLONE_THREAD`
  (threads stay allowed);
- `clone3` answers ENOSYS, so the C library falls back to `clone`, whose flags the filter can read (`clone3`
  passes them in memory, out of a filter's reach);
- system calls of another ABI (x32, i386 through `int 0x80`) kill the process (libseccomp's default).

libseccomp comes through the `seccomp` module (libseccomp's own binding) when installed, else `pyseccomp`
(a ctypes binding with the same API, from PyPI); both need the libseccomp2 shared library (a Debian base
package). Runs in the trusted parent only.
"""

from __future__ import annotations

import errno
import functools
import tempfile
from typing import Any

# from linux/sched.h
CLONE_THREAD = 0x00010000
_CLONE_NEW_FLAGS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x02000000,
                    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
                    "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
ALWAYS_DENIED = ("unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount",
                 "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace",
                 "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "bpf", "perf_event_open",
                 "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key",
                 "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
                 "reboot", "swapon", "swapoff", "open_by_handle_at", "name_to_handle_at", "acct", "syslog",
                 "quotactl", "lookup_dcookie", "iopl", "ioperm")
PROCESS_CREATION = ("fork", "vfork")


class SeccompUnavailableError(RuntimeError):
    """No libseccomp binding (or library) could be loaded."""


def _binding() -> Any:
    try:
        import seccomp  # libseccomp's own binding (Debian: python3-seccomp)

        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: the binding found no libseccomp
        raise SeccompUnavailableError(f"no libseccomp binding: {type(exc).__name__}: {exc} "
                                      "(pip install pyseccomp; apt-get install libseccomp2)") from exc
    return pyseccomp


@functools.lru_cache(maxsize=4)
def seccomp_bpf(deny_processes: bool) -> bytes:
    """The compiled filter (a BPF program, struct sock_filter[]) for bwrap's --seccomp; see the module doc."""
    sc = _binding()
    deny = sc.ERRNO(errno.EPERM)
    filt = sc.SyscallFilter(sc.ALLOW)

    def rule(action: int, name: str, *args: Any) -> None:
        try:
            filt.add_rule(action, name, *args)
        except (ValueError, OSError, RuntimeError):  # unknown to this libseccomp or arch: nothing to deny
            if name in ("clone", "unshare", "setns", "mount", "ptrace"):
                raise  # these exist on every architecture we run on: failing to deny them is fatal

    for name in ALWAYS_DENIED:
        rule(deny, name)
    for flag in _CLONE_NEW_FLAGS.values():
        rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))  # x86-64 and aarch64: flags are argument 0
    rule(sc.ERRNO(errno.ENOSYS), "clone3")
    if deny_processes:
        for name in PROCESS_CREATION:
            rule(deny, name)
        rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise SeccompUnavailableError(f"libseccomp exported a malformed filter ({len(program)} bytes)")
    return program
