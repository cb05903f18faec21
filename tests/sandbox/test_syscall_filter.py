"""The seccomp program: assembled by hand for x86_64 and aarch64, and what it refuses inside a real sandbox."""

from __future__ import annotations

import platform
import struct

import pytest

from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, SandboxLimits
from tslightning.sandbox.syscall_filter import (
    _ABIS,
    REFUSED_ALWAYS,
    REFUSED_IN_VERIFIER,
    supported_machines,
    syscall_filter,
)

_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000


def _run_filter(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the opcodes the filter uses, over one struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    instructions = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = instructions[pc]
        if code == 0x20:
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:
            pc += jt if accumulator == k else jf
        elif code == 0x35:
            pc += jt if accumulator >= k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", supported_machines())
@pytest.mark.parametrize("verifier", [False, True])
def test_each_listed_call_is_refused_and_others_allowed(machine, verifier):
    abi = _ABIS[machine]
    program = syscall_filter(machine, verifier=verifier)
    refused = set(REFUSED_ALWAYS) | (set(REFUSED_IN_VERIFIER) if verifier else set())
    for name, number in abi.numbers.items():
        verdict = _run_filter(program, abi.audit_arch, number, arg0=0)
        if name in refused:
            assert verdict == _RET_ERRNO | 1, name  # EPERM
        else:
            assert verdict == _RET_ALLOW, name
    for other in (0, 1, 59, 56, 231):  # read, write, execve, clone, exit_group on x86_64 (harmless elsewhere)
        assert _run_filter(program, abi.audit_arch, other) == _RET_ALLOW
    prlimit = abi.numbers["prlimit64"]
    assert _run_filter(program, abi.audit_arch, prlimit, arg0=0) == _RET_ALLOW  # its own limits
    assert _run_filter(program, abi.audit_arch, prlimit, arg0=7) == _RET_ERRNO | 1
    assert _run_filter(program, abi.audit_arch, prlimit, arg0=1 << 32) == _RET_ERRNO | 1
    assert _run_filter(program, 0x40000003, 1) == _RET_ERRNO | 38  # i386: ENOSYS for everything
    if abi.has_x32:
        assert _run_filter(program, abi.audit_arch, 0x40000000 | 250) == _RET_ERRNO | 38


def test_unknown_machines_are_named():
    with pytest.raises(ValueError, match="no seccomp filter for machine 'riscv64'"):
        syscall_filter("riscv64")


@pytest.mark.skipif(platform.machine() not in supported_machines(), reason="no filter for this machine")
def test_inside_a_sandbox_keyrings_affinity_and_foreign_limits_are_refused():
    keyctl = _ABIS[platform.machine()].numbers["keyctl"]
    probe = (
        "import ctypes, os, resource\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('keyctl', libc.syscall({keyctl}, 0, -3, 0), ctypes.get_errno())\n"
        "try: os.sched_setaffinity(0, os.sched_getaffinity(0))\n"
        "except PermissionError: print('affinity refused')\n"
        "try: resource.prlimit(1, resource.RLIMIT_NOFILE)\n"
        "except PermissionError: print('prlimit refused')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); print('own limits ok')\n"
    )
    with AttemptDirectory() as attempt:
        (attempt.app / "probe.py").write_text(probe)
        result = BubblewrapSandbox(attempt, limits=SandboxLimits(timeout_s=20)).run("python3 probe.py")
    assert result.ok, result
    assert result.output.splitlines() == ["keyctl -1 1", "affinity refused", "prlimit refused", "own limits ok"]
