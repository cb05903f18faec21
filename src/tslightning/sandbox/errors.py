"""Errors of the sandbox: a backend that cannot be used here, and a command that could not be started."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command: what a command does is reported in its ``CommandResult``)."""


class SandboxUnavailableError(SandboxError):
    """The chosen ``sandbox.backend`` cannot run on this machine; the message names the fix."""
