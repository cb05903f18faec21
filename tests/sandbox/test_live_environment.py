"""One live environment per attempt: what a command leaves running is there for the next; verifiers end it."""

from __future__ import annotations

import pytest

from tslightning.sandbox import AttemptDirectory, LiveBubblewrapSandbox, SandboxLimits, make_sandbox

LIMITS = SandboxLimits(timeout_s=20)


@pytest.fixture
def live():
    with AttemptDirectory() as attempt:
        sandbox = make_sandbox("bubblewrap", attempt=attempt, limits=LIMITS, live=True)
        assert isinstance(sandbox, LiveBubblewrapSandbox)
        try:
            yield sandbox
        finally:
            sandbox.close()


SERVER = "python3 -m http.server 8765 --bind 127.0.0.1 >/tmp/server.log 2>&1 &"
PROBE = (
    'python3 -c "import time, urllib.request\nfor _ in range(100):\n    try:\n'
    "        print(urllib.request.urlopen('http://127.0.0.1:8765/').status); break\n"
    '    except OSError: time.sleep(0.05)"'
)


def test_a_server_started_by_one_command_answers_the_next(live):
    started = live.run(f"{SERVER} echo started; echo note > /tmp/kept")
    assert started.exit_code == 0 and started.output == "started\n"
    probe = live.run(f"{PROBE}; cat /tmp/kept; pwd", cwd="/app")
    assert probe.output == "200\nnote\n/app\n", probe.output
    assert live.starts == 1  # both commands in one environment


def test_each_command_keeps_its_own_variables_and_limits(live):
    assert live.run("export X=1; echo ${X:-unset}", env={"Y": "2"}).output == "1\n"
    assert live.run("echo ${X:-unset} $Y").output == "unset\n"
    cut = live.run("sleep 30", limits=SandboxLimits(timeout_s=1))
    assert cut.timed_out and cut.exit_code is None


def test_late_output_of_a_background_job_neither_holds_nor_joins_the_command(live):
    result = live.run("(sleep 2; echo late) & echo now")
    assert result.output == "now\n" and result.exit_code == 0
    assert live.run("sleep 2.5; echo next").output == "next\n"  # the late line went nowhere


def test_a_timed_out_command_is_killed_but_not_what_earlier_commands_left(live):
    live.run("sleep 300 & echo $! > /tmp/pid")
    assert live.run("sleep 30", limits=SandboxLimits(timeout_s=1)).timed_out
    assert live.run('kill -0 "$(cat /tmp/pid)" && echo alive').output == "alive\n"


def test_a_verifier_run_ends_the_environment_first(live):
    live.run("sleep 300 & echo started")
    verifier = live.run("ps -e -o comm=", mounts=("app", "tests", "logs"), verifier=True)
    assert "sleep" not in verifier.output and not live.live
    again = live.run("ps -e -o comm=")
    assert "sleep" not in again.output and live.starts == 2  # a fresh environment; /app kept


def test_closing_ends_every_process(live):
    live.run("sleep 300 &")
    keeper = live._keeper
    live.close()
    assert keeper.poll() is not None and not live.live
    live.close()  # idempotent


def test_the_network_is_the_hosts_only_where_allowed(live):
    listener = "python3 -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print('bound')\""
    interfaces = 'python3 -c "import socket; print(sorted(n for _, n in socket.if_nameindex()))"'
    assert live.run(interfaces).output == "['lo']\n"  # its own loopback only
    live.end()
    live.agent_network = True
    assert live.run(interfaces).output != "['lo']\n" and live.run(listener).output == "bound\n"
    assert live.run(interfaces, mounts=("app", "tests", "logs"), verifier=True).output == "['lo']\n"


def test_a_service_binds_a_privileged_port_as_in_a_container(live):
    if live.host_uid is None:
        pytest.skip("the environment's own network namespace is made by a root trainer")
    live.run(SERVER.replace("8765", "80"))
    assert live.run(PROBE.replace("8765", "80")).output == "200\n"
    assert live.run("cat /proc/sys/net/ipv4/ip_unprivileged_port_start").output == "0\n"


def test_the_first_command_finds_the_start_up_service_listening(live):
    live.startup = ("sleep 0.4; exec python3 -m http.server 8766 --bind 127.0.0.1", "/", {})
    once = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8766/').status)\""
    assert live.run(once).output == "200\n"  # no retry: the service already listens


def test_what_commands_leave_counts_against_the_environments_memory():
    hog = "python3 -c 'import time; b = bytearray(45 * 2**20); time.sleep(60)' &"
    with AttemptDirectory() as attempt:
        live = LiveBubblewrapSandbox(attempt, limits=SandboxLimits(timeout_s=20, memory_bytes=96 * 2**20))
        try:
            started = live.run(f"{hog} {hog} echo started")
            assert started.output == "started\n"  # each process is within its own limits
            watched = live.run("sleep 2; echo survived")
            left = live.run("pgrep -c -x python3")  # pid 1 is python3.11
        finally:
            live.close()
    # Together they pass the environment's memory: everything but pid 1 is killed, the running command with it.
    assert watched.limit_hit == "memory" or watched.output == "survived\n"
    assert left.output == "0\n", left.output


def test_a_command_that_closes_its_output_early_still_ends_normally(live):
    result = live.run("echo before; exec >&- 2>&-; sleep 1; exit 4")
    assert result.output == "before\n" and result.exit_code == 4


def test_a_command_of_any_length_runs(live):
    long = "true " + "x" * 300_000 + "\necho done"  # beyond one argument (128 KiB) and a socket message
    assert live.run(long).output == "done\n"


HOLD_PROCESSES = (
    'python3 -c "import os, time\nfor _ in range(40):\n    try:\n        pid = os.fork()\n    except OSError:\n'
    '        break\n    if pid == 0:\n        os.setsid(); time.sleep(60); os._exit(0)"'
)
"""Processes in sessions of their own up to the process limit (Python's fork fails at once, bash's retries)."""


def test_processes_left_holding_the_process_limit_do_not_end_the_environment():
    with AttemptDirectory() as attempt:
        live = LiveBubblewrapSandbox(attempt, limits=SandboxLimits(timeout_s=20, max_processes=24))
        try:
            live.run(HOLD_PROCESSES)
            # bash must fork, and the processes left hold the limit: it retries until its time-out
            forking = live.run("/bin/true; /bin/echo forked", limits=SandboxLimits(timeout_s=3, max_processes=24))
            assert forking.limit_hit == "processes" and "forked" not in forking.output, forking.output
            assert live.run("echo still").output == "still\n"  # pid 1 forks the next command regardless
            assert live.live and live.starts == 1
        finally:
            live.close()
