"""A task's ``environment/Dockerfile``, read into its instructions (the subset task images use), without Docker.

What is read: comments and blank lines dropped, ``\\`` line continuations joined, heredocs (``RUN <<EOF``,
``COPY <<EOF /path``) kept as the instruction's ``heredocs``, the exec form (``["a", "b"]``) and the shell form of
``RUN`` / ``CMD`` / ``ENTRYPOINT``, ``COPY`` / ``ADD`` flags (``--chown``, ``--from``, ...), and ``ARG`` / ``ENV``
values substituted (``$VAR``, ``${VAR}``, ``${VAR:-default}``) into later ``FROM``, ``WORKDIR``, ``ENV``, ``COPY``,
``ADD`` and ``USER`` arguments, as Docker's builder substitutes them. ``RUN`` text is kept as written (the shell
expands it at build time).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tslightning.tasks.harbor.field_reader import HarborFormatError

BASE_VARIABLES = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
"""What the base images define before the Dockerfile's own ``ENV`` (``ENV PATH=/opt/x/bin:$PATH`` extends it)."""
SUBSTITUTED = frozenset({"FROM", "WORKDIR", "ENV", "COPY", "ADD", "USER", "ARG", "EXPOSE", "LABEL", "VOLUME"})
_HEREDOC = re.compile(r"<<(-?)(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(HarborFormatError):
    """The Dockerfile cannot be read (the message names the line and what is wrong)."""


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction.

    Attributes:
        keyword: ``FROM``, ``RUN``, ``COPY``, ... (upper case).
        arguments: The text after the keyword, variables substituted where Docker substitutes them.
        line: Its first line in the file (1-based).
        flags: ``--name=value`` options before the arguments (``COPY --chown=1000 ...``).
        exec_form: The JSON array form's items (``CMD ["python3", "app.py"]``), else ``None``.
        heredocs: Bodies of the ``<<NAME`` heredocs the instruction names, in order.
    """

    keyword: str
    arguments: str
    line: int
    flags: dict[str, str] = field(default_factory=dict)
    exec_form: tuple[str, ...] | None = None
    heredocs: tuple[str, ...] = ()

    def words(self) -> list[str]:
        """The arguments split as a shell would (the exec form's items when given that way)."""
        if self.exec_form is not None:
            return list(self.exec_form)
        try:
            return shlex.split(self.arguments)
        except ValueError:
            return self.arguments.split()

    @property
    def shell_command(self) -> str:
        """``RUN`` / ``CMD`` / ``ENTRYPOINT`` as one shell command (the exec form's items quoted)."""
        if self.exec_form is not None:
            return shlex.join(self.exec_form)
        return self.arguments

    @property
    def run_script(self) -> str:
        """What a ``RUN`` hands its shell, as BuildKit does: a leading heredoc (``RUN <<EOF``) is the script itself;
        heredocs a command reads (``RUN python3 - <<'EOF'``) stay in the script, each body and its closing line
        after the command line, so the command reads the body on its stdin."""
        if self.arguments.startswith("<<") and self.heredocs:
            return self.heredocs[0]
        terminators = [match.group(3) for match in _HEREDOC.finditer(self.arguments)]
        if self.exec_form is not None or not terminators:
            return self.shell_command
        bodies = zip(self.heredocs, terminators, strict=True)
        return self.arguments + "\n" + "".join(f"{body}{end}\n" for body, end in bodies)


@dataclass(frozen=True)
class Dockerfile:
    """A parsed Dockerfile: its instructions in order, and the file it came from."""

    path: Path
    instructions: tuple[Instruction, ...]

    @classmethod
    def read(cls, path: str | Path) -> Dockerfile:
        """Parse ``path``.

        Raises:
            DockerfileError: the file is not UTF-8, has no ``FROM``, or an instruction is malformed.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise DockerfileError(f"{path.name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        return cls(path, parse_dockerfile(text, path.name))

    def of(self, *keywords: str) -> list[Instruction]:
        """The instructions with one of ``keywords``, in order."""
        return [instruction for instruction in self.instructions if instruction.keyword in keywords]

    @property
    def stages(self) -> int:
        """How many ``FROM`` stages the build has (a multi-stage build has more than one)."""
        return len(self.of("FROM"))

    @property
    def base_image(self) -> str:
        """The last stage's ``FROM`` image (without ``AS name`` and ``--platform``)."""
        return self.of("FROM")[-1].words()[0]


def parse_dockerfile(text: str, name: str = "Dockerfile") -> tuple[Instruction, ...]:
    """The instructions of Dockerfile ``text`` (see the module docstring); ``name`` appears in errors.

    Raises:
        DockerfileError: no ``FROM``, an unterminated heredoc, a malformed exec form, or a line without a keyword.
    """
    lines = text.splitlines()
    instructions: list[Instruction] = []
    variables = dict(BASE_VARIABLES)
    index = 0
    while index < len(lines):
        logical, start, index = _logical_line(lines, index)
        if not logical:
            continue
        keyword, _, rest = logical.partition(" ")
        if not re.fullmatch(r"[A-Za-z]+", keyword):
            raise DockerfileError(f"{name}: line {start + 1}: {keyword!r} is not a Dockerfile instruction")
        keyword = keyword.upper()
        heredocs, index = _heredocs(rest, lines, index, name, start)
        instruction = _instruction(keyword, rest.strip(), start + 1, heredocs, variables, name)
        _remember(instruction, variables)
        instructions.append(instruction)
    if not any(instruction.keyword == "FROM" for instruction in instructions):
        raise DockerfileError(f"{name}: no FROM instruction (every image starts from a base)")
    return tuple(instructions)


def substitute(text: str, variables: dict[str, str]) -> str:
    """``text`` with ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+value}`` replaced from ``variables``
    (unset: empty), as Docker's builder does."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(4)
        current = variables.get(name, "")
        if match.group(2) == "-":
            return current or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if current else ""
        return current

    return _VARIABLE.sub(value, text)


def _logical_line(lines: list[str], index: int) -> tuple[str, int, int]:
    """The next instruction from ``lines[index]`` on, continuations joined (comment lines inside dropped); returns
    it, the index of its first line and the index after it."""
    parts: list[str] = []
    start = index
    while index < len(lines):
        line = lines[index]
        index += 1
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            start = index if not parts else start
            continue
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        parts.append(stripped)
        break
    return " ".join(part.strip() for part in parts if part.strip()), start, index


def _heredocs(rest: str, lines: list[str], index: int, name: str, start: int) -> tuple[tuple[str, ...], int]:
    bodies = []
    for match in _HEREDOC.finditer(rest):
        strip_tabs, terminator = match.group(1) == "-", match.group(3)
        body: list[str] = []
        while True:
            if index >= len(lines):
                raise DockerfileError(f"{name}: line {start + 1}: heredoc <<{terminator} has no closing line")
            line = lines[index]
            index += 1
            if (line.lstrip("\t") if strip_tabs else line) == terminator:
                break
            body.append(line.lstrip("\t") if strip_tabs else line)
        bodies.append("\n".join(body) + "\n")
    return tuple(bodies), index


def _instruction(
    keyword: str, rest: str, line: int, heredocs: tuple[str, ...], variables: dict[str, str], name: str
) -> Instruction:
    flags: dict[str, str] = {}
    while rest.startswith("--") and keyword in ("FROM", "COPY", "ADD", "RUN"):
        flag, _, rest = rest.partition(" ")
        key, _, value = flag[2:].partition("=")
        flags[key] = value
        rest = rest.strip()
    if keyword in SUBSTITUTED and keyword != "ARG":
        rest = substitute(rest, variables)
    exec_form = None
    if rest.startswith("[") and keyword in ("RUN", "CMD", "ENTRYPOINT", "COPY", "ADD", "SHELL", "VOLUME"):
        try:
            items = json.loads(rest)
        except json.JSONDecodeError:
            items = None  # Docker runs a malformed exec form as shell text
        if isinstance(items, list) and all(isinstance(item, str) for item in items):
            exec_form = tuple(items)
        elif items is not None:
            raise DockerfileError(f"{name}: line {line}: {keyword}'s JSON form must be an array of strings")
    return Instruction(keyword, rest, line, flags, exec_form, heredocs)


def _remember(instruction: Instruction, variables: dict[str, str]) -> None:
    """``ARG`` and ``ENV`` values, for the substitution in later instructions."""
    if instruction.keyword == "ARG":
        for word in instruction.words():
            key, has_value, value = word.partition("=")
            if has_value:
                variables[key] = substitute(value, variables)
            else:
                variables.setdefault(key, "")
    elif instruction.keyword == "ENV":
        variables.update(env_pairs(instruction))


def env_pairs(instruction: Instruction) -> dict[str, str]:
    """``ENV`` as name → value: ``ENV A=1 B="two words"``, or the old ``ENV NAME value with spaces``."""
    words = instruction.words()
    if words and "=" not in words[0]:
        return {words[0]: instruction.arguments.partition(" ")[2].strip()}
    return dict(word.partition("=")[::2] for word in words)
