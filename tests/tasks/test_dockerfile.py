"""Dockerfiles read as Docker's builder reads them: continuations, heredocs, exec form, flags, ARG/ENV substitution."""

from __future__ import annotations

import pytest

from tslightning.tasks.harbor.dockerfile import Dockerfile, DockerfileError, env_pairs, parse_dockerfile

TEXT = """\
# syntax=docker/dockerfile:1
ARG PY=3.13
FROM python:${PY}-slim-bookworm AS base

ENV APP_HOME=/srv/app \\
    GREETING="hello world"
ENV PATH=/opt/venv/bin:$PATH
WORKDIR ${APP_HOME}
RUN apt-get update && \\
    # a comment inside a continuation is dropped
    apt-get install -y --no-install-recommends jq
COPY --chown=1000:1000 data/ ${APP_HOME}/data/
COPY <<MOTD /etc/motd
welcome
MOTD
CMD ["python3", "-m", "http.server", "8000"]
"""


def test_instructions_are_read_in_order_with_substitution():
    instructions = parse_dockerfile(TEXT)
    assert [i.keyword for i in instructions] == ["ARG", "FROM", "ENV", "ENV", "WORKDIR", "RUN", "COPY", "COPY", "CMD"]
    by_line = {i.line: i for i in instructions}
    assert by_line[3].arguments == "python:3.13-slim-bookworm AS base"
    assert by_line[8].arguments == "/srv/app"
    assert by_line[9].arguments == "apt-get update && apt-get install -y --no-install-recommends jq"
    assert by_line[12].flags == {"chown": "1000:1000"} and by_line[12].words() == ["data/", "/srv/app/data/"]
    assert by_line[13].heredocs == ("welcome\n",) and by_line[13].words()[-1] == "/etc/motd"
    assert by_line[16].exec_form == ("python3", "-m", "http.server", "8000")
    assert by_line[16].shell_command == "python3 -m http.server 8000"


def test_env_forms_and_path_extension():
    instructions = parse_dockerfile(TEXT)
    assert env_pairs(instructions[2]) == {"APP_HOME": "/srv/app", "GREETING": "hello world"}
    assert env_pairs(instructions[3])["PATH"].startswith("/opt/venv/bin:/usr/local/sbin:")  # the base's PATH
    legacy = parse_dockerfile("FROM debian\nENV NAME some value here\n")[1]
    assert env_pairs(legacy) == {"NAME": "some value here"}


def test_defaults_and_the_last_stage(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("FROM golang:1.22 AS build\nRUN go build\nFROM --platform=linux/amd64 ${BASE:-debian:bookworm}\n")
    dockerfile = Dockerfile.read(path)
    assert dockerfile.stages == 2 and dockerfile.base_image == "debian:bookworm"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("RUN echo hi\n", "no FROM instruction"),
        ("FROM debian\nRUN <<END\necho hi\n", "heredoc <<END has no closing line"),
        ("FROM debian\n== oops\n", "line 2: '==' is not a Dockerfile instruction"),
        ('FROM debian\nCMD ["a", 1]\n', "line 2: CMD's JSON form must be an array of strings"),
    ],
)
def test_malformed_files_name_the_line(text, message):
    with pytest.raises(DockerfileError, match=message):
        parse_dockerfile(text)


@pytest.mark.parametrize(
    ("text", "output"),
    [
        ("RUN <<EOF\necho leading\nEOF\n", "leading\n"),
        ("RUN python3 - <<'PY'\nprint('read from stdin')\nPY\n", "read from stdin\n"),
        ("RUN cat <<A && cat <<-B\nfirst\nA\n\tsecond\n\tB\n", "first\nsecond\n"),
        ('RUN ["echo", "exec form"]\n', "exec form\n"),
    ],
    ids=["leading", "command-reads-it", "two", "exec"],
)
def test_a_run_script_feeds_each_heredoc_to_the_command_that_names_it(text, output):
    """BuildKit: ``RUN <<EOF`` runs the body; ``RUN cmd <<EOF`` runs cmd with the body on its stdin (it used to run
    ``cmd`` with no body at all)."""
    import subprocess

    (instruction,) = [i for i in parse_dockerfile("FROM debian\n" + text) if i.keyword == "RUN"]
    done = subprocess.run(["sh", "-c", instruction.run_script], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, output), done.stderr
