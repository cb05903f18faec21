"""A built root shown at ``/``: read-only, with the attempt's private writable directories and files over it."""

from __future__ import annotations

from tslightning.sandbox.root_filesystem import REQUIRED_DIRS, RootFilesystem


def _root(tmp_path):
    root = tmp_path / "root"
    for name in REQUIRED_DIRS:
        (root / name).mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3").write_text("")
    (root / "etc").mkdir()
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    return root


def test_private_files_bind_over_the_roots_own(tmp_path):
    root = _root(tmp_path)
    (tmp_path / "home-copy").mkdir()
    (tmp_path / "hosts-copy").write_text("127.0.0.1 localhost\n")
    shown = RootFilesystem(root, {"/home": tmp_path / "home-copy"}, files={"/etc/hosts": tmp_path / "hosts-copy"})
    assert shown.problems() == []
    assert shown.binds() == [
        "--ro-bind", str(root), "/",
        "--bind", str(tmp_path / "home-copy"), "/home",
        "--bind", str(tmp_path / "hosts-copy"), "/etc/hosts",
    ]  # fmt: skip


def test_a_private_file_needs_a_host_file_and_a_regular_file_under_it(tmp_path):
    root = _root(tmp_path)
    (tmp_path / "copy").write_text("")
    (root / "etc" / "hostname").symlink_to("/proc/sys/kernel/hostname")
    problems = RootFilesystem(
        root,
        files={"/etc/hosts": tmp_path / "missing", "/etc/hostname": tmp_path / "copy", "/etc/x": tmp_path / "copy"},
    ).problems()
    assert f"file '/etc/hosts' -> {tmp_path / 'missing'} is not an absolute path over a host file" in problems
    assert f"file '/etc/hostname': {root}/etc/hostname is not a regular file to bind the copy over" in problems
    assert f"file '/etc/x': {root}/etc/x is not a regular file to bind the copy over" in problems
