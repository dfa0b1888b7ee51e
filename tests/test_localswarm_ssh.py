"""The command plugin dials and retries as pulumi-command 1.2.1 does (localswarm/ssh.py).

The ssh here is a stand-in on PATH that answers each dial, in turn, with what OpenSSH prints
and exits with in that situation (a refused port, a closed handshake, a dropped session), and
counts the dials: what is under test is which failures are dialled again.
"""
from __future__ import annotations

import os
import stat

import pytest

from localswarm import ssh

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----"
DIRECT = {"host": "10.0.0.21", "privateKey": KEY, "dialErrorLimit": 5}
JUMPED = {**DIRECT, "proxy": {"host": "203.0.113.7", "privateKey": KEY}}

REFUSED = (255, "", "ssh: connect to host 10.0.0.21 port 22: Connection refused")
HANDSHAKE_CLOSED = (255, "", "kex_exchange_identification: Connection closed by remote host\n"
                             "Connection closed by UNKNOWN port 65535")
NO_CHANNEL = (255, "", "channel 0: open failed: connect failed: Connection refused\nstdio forwarding failed\n"
                       "kex_exchange_identification: Connection closed by remote host")
JUMP_REFUSED = (255, "", "ssh: connect to host 203.0.113.7 port 22: Connection refused\n"
                         "kex_exchange_identification: Connection closed by remote host")
DROPPED = (255, "half done", f"{ssh.SESSION_OPEN}\nConnection to 10.0.0.21 closed by remote host.")
OK = (0, "done", f"{ssh.SESSION_OPEN}\n")


@pytest.fixture
def answers(tmp_path, monkeypatch):
    """Set the stand-in's answers, one per dial; returns a function that reads how many dials there were."""
    def set_answers(*replies):
        for i, (code, out, err) in enumerate(replies, 1):
            (tmp_path / f"reply.{i}").write_text(f"{code}\n{out}\n{err}\n")
        return lambda: int((tmp_path / "count").read_text()) if (tmp_path / "count").exists() else 0

    stub = tmp_path / "ssh"
    stub.write_text(f"""#!/bin/bash
n=$(( $(cat {tmp_path}/count 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/count
{{ read -r code; read -r out; err=$(cat); }} < {tmp_path}/reply.$n
[ -n "$out" ] && echo "$out"
printf '%s\\n' "$err" >&2
exit "$code"
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return set_answers


def run(connection):
    return ssh.run(connection, "true", sleep=lambda _: None)


def test_a_direct_dial_is_retried_until_sshd_answers(answers):
    dials = answers(REFUSED, HANDSHAKE_CLOSED, OK)
    assert run(DIRECT).stdout == "done" and dials() == 3


def test_through_a_jump_host_a_refused_channel_and_a_refused_jump_host_are_retried(answers):
    dials = answers(NO_CHANNEL, JUMP_REFUSED, OK)
    result = run(JUMPED)
    assert result.stdout == "done" and result.dials == 3 and dials() == 3
    assert ssh.SESSION_OPEN not in result.stderr


def test_through_a_jump_host_a_failed_handshake_fails_the_command(answers):
    dials = answers(HANDSHAKE_CLOSED, OK)
    with pytest.raises(ssh.CommandFailed, match="handshake failed.*retries it on the connection it closed"):
        run(JUMPED)
    assert dials() == 1  # the retries are on the closed connection: none of them can succeed


def test_behind_a_jump_host_only_the_jump_hosts_dial_is_bounded_as_the_providers_dial_timeout_is(tmp_path):
    # The provider's handshake with the host runs on the jump host's channel with no deadline: a
    # freshly booted node slow to send its banner is waited for, not failed (CI met the difference).
    argv = ssh.argv({**JUMPED, "perDialTimeout": 7}, "true", tmp_path)
    (proxy_command,) = [a for a in argv if a.startswith("ProxyCommand=")]
    assert "ConnectTimeout=7" in proxy_command
    assert not any(a.startswith("ConnectTimeout") for a in argv if not a.startswith("ProxyCommand="))
    assert "ConnectTimeout=7" in ssh.argv({**DIRECT, "perDialTimeout": 7}, "true", tmp_path)


def test_a_script_whose_session_dropped_is_not_run_again(answers):
    dials = answers(DROPPED, OK)
    with pytest.raises(ssh.CommandFailed, match="session dropped.*not run again.*without exit status"):
        run(DIRECT)
    assert dials() == 1


def test_too_many_failed_dials_fail_with_the_last_error(answers):
    dials = answers(*[REFUSED] * 6, OK)
    with pytest.raises(ssh.CommandFailed, match="failed 6 times.*Connection refused"):
        run(DIRECT)
    assert dials() == 6
