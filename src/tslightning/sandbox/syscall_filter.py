"""The seccomp filter of every bubblewrap sandbox: a classic-BPF program that refuses the few system calls that
reach outside the attempt although namespaces and an unprivileged uid do not stop them.

Refused with ``EPERM`` in every command:

- ``add_key``, ``request_key``, ``keyctl``: the kernel keyrings are not namespaced; without this an agent reads the
  trainer's session keyring and one attempt leaves notes for the next in the sandbox uid's user keyring.
- ``sched_setaffinity``: a command stays on the cores it was started on (the rollout's), it cannot widen onto the
  learner's.
- ``prlimit64`` on another process (a non-zero pid): without it a process could lower the limits of a sibling,
  e.g. make a verifier's write of its reward file fail.

Refused with ``EPERM`` in verifier runs (``verifier=True``) only, where the verifier may execute code the agent wrote:
``ptrace``, ``process_vm_readv``, ``process_vm_writev`` and ``pidfd_getfd`` (reading or changing another process of
the verifier: the machine has no Yama ptrace restriction to rely on). Agent commands keep ``strace`` and ``gdb``.

Every system call of a foreign ABI (i386 or x32 on x86_64, arm32 on aarch64) fails with ``ENOSYS``, so the numbers
above cannot be reached under another ABI's numbering; 32-bit programs cannot run in the sandbox.

bwrap loads the program (``--seccomp FD``) after setting ``no_new_privs``, just before it executes the command; it
holds for every process of the command and cannot be removed.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass
from types import MappingProxyType

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = 32-bit word at offset k of struct seccomp_data
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian on both ABIs).
_NR, _ARCH, _ARG0_LOW, _ARG0_HIGH = 0, 4, 16, 20
_X32_SYSCALL_BIT = 0x40000000


@dataclass(frozen=True)
class _Abi:
    audit_arch: int
    numbers: MappingProxyType[str, int]
    has_x32: bool = False


_ABIS = MappingProxyType(
    {
        "x86_64": _Abi(
            0xC000003E,  # AUDIT_ARCH_X86_64
            MappingProxyType(
                {
                    "add_key": 248,
                    "request_key": 249,
                    "keyctl": 250,
                    "sched_setaffinity": 203,
                    "prlimit64": 302,
                    "ptrace": 101,
                    "process_vm_readv": 310,
                    "process_vm_writev": 311,
                    "pidfd_getfd": 438,
                }
            ),  # fmt: skip
            has_x32=True,
        ),
        "aarch64": _Abi(
            0xC00000B7,  # AUDIT_ARCH_AARCH64
            MappingProxyType(
                {
                    "add_key": 217,
                    "request_key": 218,
                    "keyctl": 219,
                    "sched_setaffinity": 122,
                    "prlimit64": 261,
                    "ptrace": 117,
                    "process_vm_readv": 270,
                    "process_vm_writev": 271,
                    "pidfd_getfd": 438,
                }
            ),  # fmt: skip
        ),
    }
)

REFUSED_ALWAYS = ("add_key", "request_key", "keyctl", "sched_setaffinity")
"""Refused (``EPERM``) in every sandboxed command."""
REFUSED_IN_VERIFIER = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd")
"""Also refused while a verifier runs."""


def supported_machines() -> tuple[str, ...]:
    """``platform.machine()`` values the filter can be assembled for."""
    return tuple(_ABIS)


def syscall_filter(machine: str | None = None, *, verifier: bool = False) -> bytes:
    """The filter program as bwrap's ``--seccomp`` reads it: ``struct sock_filter`` entries in native byte order.

    Args:
        machine: ``platform.machine()`` of the host (default: this one).
        verifier: also refuse the calls of :data:`REFUSED_IN_VERIFIER`.

    Raises:
        ValueError: the machine is not one of :func:`supported_machines`.
    """
    machine = machine or platform.machine()
    if machine not in _ABIS:
        raise ValueError(f"no seccomp filter for machine {machine!r}; supported: {list(_ABIS)}")
    abi = _ABIS[machine]
    refused = [abi.numbers[name] for name in (*REFUSED_ALWAYS, *(REFUSED_IN_VERIFIER if verifier else ()))]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in _program(abi, refused))


def _program(abi: _Abi, refused: list[int]) -> list[tuple[int, int, int, int]]:
    """The instructions; jump offsets count instructions to skip after the current one."""
    deny_eperm = (_RET, 0, 0, _RET_ERRNO | errno.EPERM)
    deny_enosys = (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS)
    allow = (_RET, 0, 0, _RET_ALLOW)
    head = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, abi.audit_arch), deny_enosys, (_LD_W_ABS, 0, 0, _NR)]
    if abi.has_x32:
        head += [(_JGE, 0, 1, _X32_SYSCALL_BIT), deny_enosys]
    # Layout after the head: one JEQ per refused number, the prlimit64 JEQ, ALLOW, EPERM, then the prlimit64 check.
    body = []
    count = len(refused)
    for index, number in enumerate(refused):
        body.append((_JEQ, count - index + 1, 0, number))  # to EPERM: skip the remaining JEQs and ALLOW
    body.append((_JEQ, 2, 0, abi.numbers["prlimit64"]))  # to the pid check: skip ALLOW and EPERM
    body += [allow, deny_eperm]
    pid_check = [
        (_LD_W_ABS, 0, 0, _ARG0_LOW),
        (_JEQ, 0, 3, 0),  # low word non-zero: another process
        (_LD_W_ABS, 0, 0, _ARG0_HIGH),
        (_JEQ, 0, 1, 0),
        allow,  # prlimit64(0, ...): the calling process itself (what setrlimit and ulimit use)
        deny_eperm,
    ]
    return head + body + pid_check
