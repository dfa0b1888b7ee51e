"""pulumi-command's remote.Command, as its provider runs one, over OpenSSH: dial, run, fail the same way.

What the provider does (pulumi-command 1.2.1, provider/pkg/provider/remote/connection.go):
it dials the host and retries failed dials up to dialErrorLimit times, each bounded by
perDialTimeout; without hostKey it accepts any host key. Through a proxy (jump host) it
dials in three retried steps: the jump host; a channel from it to the host (a refused port
is retried); and the SSH handshake, retried on that same channel, which a failed handshake
has closed: a handshake that fails behind a jump host (a closed connection, a refused key,
a host key that does not match) fails the command, where a direct dial would try again.
It runs `create` in one session, with stdin when given, and the command's exit status
decides: a failure is "Process exited with status N: running ...", followed by the
command's output. A session that drops while the script runs is a failure too, never run
again. stdout and stderr lose one trailing newline.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# What OpenSSH prints when it never reached a shell on the host: these are dial errors,
# which the provider retries (sshd not up yet, a key not yet installed by cloud-init).
_DIAL_ERRORS = ("connection refused", "connection timed out", "no route to host", "timed out",
                "connection closed", "connection reset", "kex_exchange_identification", "permission denied",
                "network is unreachable", "broken pipe", "could not resolve",
                # The provider retries a handshake that fails on a pinned host key like any other dial.
                "host key verification failed")


# The remote shell says this first on stderr: after it, the script has started, and a dropped
# session is the script's failure, not a dial to retry.
SESSION_OPEN = "lsw-session-open"
# What the jump host's own ssh (the ProxyCommand) prints when it could not open a channel to the
# host: the provider's "Dial from proxy" step, retried.
_CHANNEL_ERRORS = ("stdio forwarding failed", "open failed", "administratively prohibited")


# What OpenSSH prints when a session it had opened goes away under the command.
_DROPPED = ("closed by remote host", "connection reset", "broken pipe", "client_loop", "timed out")


class CommandFailed(Exception):
    """The command ran and exited non-zero, or the host could not be dialled: the provider's error."""


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    dials: int  # how many dials it took
    seconds: float


# Key exchanges as the provider's Go client (golang.org/x/crypto/ssh) offers them: curve25519 first, after
# mlkem768x25519 in versions built with Go 1.24 or later, which this host's OpenSSH (9.2) lacks. The Go client
# never offers OpenSSH's own first choice, sntrup761x25519, which took 56 ms more a dial here.
_GO_CLIENT_KEX = "curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,ecdh-sha2-nistp384," \
    "ecdh-sha2-nistp521,diffie-hellman-group14-sha256"


def _options(key: Path, timeout: float | None, known_hosts: Path | None) -> list[str]:
    """timeout: OpenSSH's ConnectTimeout, which bounds the TCP connect and also the wait for the
    server's banner; None sets none (the host behind a jump host, see argv)."""
    checking = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"] if known_hosts else \
        ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    bound = ["-o", f"ConnectTimeout={int(timeout)}"] if timeout is not None else []
    return ["-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            *bound, "-o", "ServerAliveInterval=15", "-o", f"KexAlgorithms={_GO_CLIENT_KEX}", *checking]


def _known_hosts(folder: Path, name: str, host: str, key: str | None) -> Path | None:
    if not key:
        return None  # the provider: "If not provided, the host key will be ignored."
    path = folder / f"known_hosts.{name}"
    path.write_text(f"{host} {key.strip()}\n")
    return path


def argv(connection: dict, script: str, folder: Path) -> list[str]:
    """The ssh command line for one session; the private keys go to files in `folder` (0600)."""
    key = folder / "id"
    if not key.exists():
        key.write_text(connection["privateKey"].strip() + "\n")
        key.chmod(0o600)
    timeout = float(connection.get("perDialTimeout") or 15)
    target = f"{connection.get('user') or 'root'}@{connection['host']}"
    known = _known_hosts(folder, connection["host"], connection["host"], connection.get("hostKey"))
    proxy = connection.get("proxy")
    # Behind a jump host the provider runs the handshake on the channel the jump host opened
    # (ssh.NewClientConn), and the dial timeout (ClientConfig.Timeout) bounds only ssh.Dial's TCP
    # connect: nothing bounds the wait for the host's banner, which a freshly booted node under load
    # can be slow to send. OpenSSH's ConnectTimeout would bound it, and fail where the provider waits.
    cmd = ["ssh", *_options(key, None if proxy else timeout, known), "-p", str(int(connection.get("port") or 22))]
    if proxy:
        proxy_key = folder / "proxy_id"
        if not proxy_key.exists():
            proxy_key.write_text((proxy.get("privateKey") or connection["privateKey"]).strip() + "\n")
            proxy_key.chmod(0o600)
        jump_known = _known_hosts(folder, f"proxy-{proxy['host']}", proxy["host"], proxy.get("hostKey"))
        jump = ["ssh", *_options(proxy_key, timeout, jump_known), "-p", str(int(proxy.get("port") or 22)),
                "-W", "%h:%p", f"{proxy.get('user') or 'root'}@{proxy['host']}"]
        cmd += ["-o", f"ProxyCommand={shlex.join(jump)}"]
    return [*cmd, target, f"printf '%s\\n' {SESSION_OPEN} >&2; {script}"]


def run(connection: dict, script: str, *, stdin: str | None = None, timeout_s: float = 3600,
        sleep=time.sleep) -> Result:
    """Run `script` as remote.Command's create does; raise CommandFailed as the provider would."""
    limit = int(connection.get("dialErrorLimit") or 10)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lsw-ssh-") as tmp:
        command = argv(connection, script, Path(tmp))
        dials, delay = 0, 0.5
        while True:
            dials += 1
            proc = subprocess.run(command, input=stdin or "", capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "SSH_AUTH_SOCK": ""})
            opened = f"{SESSION_OPEN}\n" in proc.stderr
            stderr = proc.stderr.replace(f"{SESSION_OPEN}\n", "", 1)
            if opened and proc.returncode == 255 and any(e in stderr.lower() for e in _DROPPED):
                raise CommandFailed(f"{connection['host']}: the session dropped while the command ran (it is not "
                                    f"run again): remote command exited without exit status or exit signal:\n"
                                    f"{proc.stdout}{stderr}")
            dial_error = not opened and proc.returncode == 255 and any(e in stderr.lower() for e in _DIAL_ERRORS)
            if not dial_error:
                break
            if _behind_jump_host(connection, stderr) == "handshake":
                raise CommandFailed(f"dial {connection['host']} through {connection['proxy']['host']}: the handshake "
                                    f"failed, and the provider retries it on the connection it closed: "
                                    f"{stderr.strip()}")
            if limit >= 0 and dials > limit:
                raise CommandFailed(f"dial {connection['host']}: failed {dials} times: {proc.stderr.strip()}")
            sleep(delay)
            delay = min(delay * 1.5, 5.0)
    if proc.returncode != 0:
        first = script.strip().splitlines()[0] if script.strip() else ""
        raise CommandFailed(f"Process exited with status {proc.returncode}: running {first[:80]!r}...:\n"
                            f"{proc.stdout}{stderr}")
    return Result(proc.stdout.removesuffix("\n"), stderr.removesuffix("\n"), dials,
                  round(time.monotonic() - started, 2))


def _behind_jump_host(connection: dict, stderr: str) -> str:
    """Which of the provider's three dials failed: "direct" (no proxy), "jump" (the jump host itself,
    named in its ssh's words), "channel" (the jump host could not reach the host) or "handshake"."""
    proxy = connection.get("proxy")
    if not proxy:
        return "direct"
    if proxy["host"] in stderr:
        return "jump"
    if any(e in stderr.lower() for e in _CHANNEL_ERRORS):
        return "channel"
    return "handshake"
