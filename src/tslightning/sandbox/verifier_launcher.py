"""The host side of a verifier run beside a live environment (and of the environment's start): run as root by the
trainer, it prepares what bwrap cannot and then becomes the verifier's (the environment's) bwrap under its uid.

``verifier_launcher.py [--net FD | --new-net 1] --uid UID --agent-uid AGENT [--idmap PATH]... -- BWRAP_ARGV...``, in
order:

1. enter the network namespace open at ``FD`` (the live environment's); or, with ``--new-net``, create the live
   environment's own: loopback up, and every port bindable by every uid (``net.ipv4.ip_unprivileged_port_start``
   0, as Docker sets in each container's namespace: a service on port 80 starts as it does in its image);
2. enter a new, private mount namespace (nothing it mounts shows on the host, and it all goes when the verifier
   ends), and over each ``PATH`` (the agent's directories: ``/app``, the root's writable copies) mount an
   *idmapped* bind of itself in which files of host uid/gid ``AGENT`` show as ``UID``'s: the verifier, under its
   own uid, owns the agent's files as the agent does (mode bits unchanged, an owner-only file readable), and what
   it writes there lands as the agent's on disk, so the agent's still-running processes keep owning everything;
3. drop to ``UID`` (gid ``UID``, no supplementary group, no capability) and execute bwrap.

Standard library only, run with ``python -I -S -B`` (it is started by path, not imported).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, 0o2000000
MOUNT_ATTR_IDMAP = 0x00100000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
_SYSCALLS = {"x86_64": (428, 429, 442), "aarch64": (428, 429, 442)}
"""open_tree, move_mount, mount_setattr (the same numbers on both ABIs)."""

_libc = ctypes.CDLL(None, use_errno=True)


def main(argv: list[str]) -> None:
    """Parse ``argv`` (see the module docstring), prepare, and execute bwrap; exits 125 with a message on failure."""
    try:
        options, command = _parse(argv)
        if options.get("net") is not None:
            _check(_libc.setns(int(options["net"]), CLONE_NEWNET), "enter the environment's network")
        elif options.get("new-net") is not None:
            _new_network()
        _check(_libc.unshare(CLONE_NEWNS), "make a private mount namespace")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make the mounts private")
        uid, agent = int(options["uid"]), int(options["agent-uid"])
        if options["idmap"]:
            mapping = _idmap_namespace(agent, uid)
            try:
                for path in options["idmap"]:
                    _idmapped_bind(path, mapping)
            finally:
                os.close(mapping)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        os.execv(command[0], command)
    except (OSError, ValueError, KeyError) as error:
        print(f"tsl-verifier-launcher: {error}", file=sys.stderr)
        sys.exit(125)


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    split = argv.index("--")
    options: dict = {"idmap": []}
    flags = argv[:split]
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name == "--idmap":
            options["idmap"].append(value)
        else:
            options[name.lstrip("-")] = value
    if not argv[split + 1 :]:
        raise ValueError("no command after --")
    return options, argv[split + 1 :]


def _new_network() -> None:
    """A new network namespace with loopback up and no privileged ports (see the module docstring)."""
    _check(_libc.unshare(CLONE_NEWNET), "make the environment's network")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as sysctl:
        sysctl.write("0\n")


def _idmap_namespace(agent: int, uid: int) -> int:
    """A user namespace whose maps send host ``agent`` to ``uid`` (uids and gids), as a descriptor: the idmapping
    of the binds. A child creates it; this process (root) writes its maps, keeps the descriptor, and ends the child."""
    ready_read, ready_write = os.pipe()
    hold_read, hold_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(ready_write, b"." if _libc.unshare(CLONE_NEWUSER) == 0 else b"!")
            os.read(hold_read, 1)  # until this process kills it (or dies: end of file)
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(hold_read)
    try:
        if os.read(ready_read, 1) != b".":
            raise OSError("could not create the idmapping's user namespace")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child}/{name}", "w") as file:
                file.write(f"{agent} {uid} 1\n")
        return os.open(f"/proc/{child}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_read)
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(hold_write)


def _idmapped_bind(path: str, userns: int) -> None:
    """Mount over ``path`` a bind of itself idmapped through ``userns`` (``open_tree``, ``mount_setattr``,
    ``move_mount``)."""
    open_tree, move_mount, mount_setattr = _SYSCALLS[os.uname().machine]
    tree = _libc.syscall(open_tree, AT_FDCWD, os.fsencode(path), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
    _check(tree, f"clone the mount of {path}")
    try:
        attributes = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_IDMAP, 0, 0, userns))
        flags = AT_EMPTY_PATH | AT_RECURSIVE
        _check(_libc.syscall(mount_setattr, tree, b"", flags, attributes, 32), f"idmap {path}")
        target = os.fsencode(path)
        _check(_libc.syscall(move_mount, tree, b"", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH), f"mount {path}")
    finally:
        os.close(tree)


def _check(result: int, action: str) -> int:
    if result < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"could not {action}: {os.strerror(number)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
