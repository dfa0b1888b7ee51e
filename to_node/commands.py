"""The scripts the program runs on a node, as root, over SSH: wait for its boot, upgrade it, its keys, its health settings.

Each is a pure function of the program's values that returns a bash script; the Pulumi
components send them (components/node_boot.py, components/node_rollout.py) and the
rehearsal's `program up` runs them on its machines. `root` prefixes every node path, so
the tests run the very same text in a scratch folder.
"""
from __future__ import annotations

from to_node.software import (KIND_ENV, SHARED_KIND_ENV, SLOTS_PER_GPU_ENV, APPLIED, BOOTSTRAP_DONE, BOOTSTRAP_FAILED, BOOTSTRAP_LOG, BOOTSTRAP_TIMINGS, HEALTH_ENV_PATH,
                           HEALTH_UNITS, INSTALL_TIMINGS, INSTALLER_PATH, RELEASE_ENV_PATH, STATE_DIR, NodeRelease,
                           env_text)
from settings.config_checks import LINUX_USER_RE, public_key_problem  # one copy of each rule
from swarm.gpu_kind import validate_kind
from swarm.script import quote, script

from swarm.node_contract import (AUTOSCALE_DIR, CLOUD_INIT_LOG, CLOUD_INIT_RESULT, CLOUD_INIT_STATUS,  # noqa: E402
                                 COST_ENV_PATH, DOCKER_DAEMON_JSON, INSTALL_UNIT)

# Written when a failed first boot has been reported: the next `pulumi up` retries the install.
BOOT_FAILURE_REPORTED = f"{STATE_DIR}/boot-failure-reported"


def _paths(root: str) -> dict[str, str]:
    return {name: quote(root + path) for name, path in (
        ("state", STATE_DIR), ("log", BOOTSTRAP_LOG), ("done", BOOTSTRAP_DONE), ("failed", BOOTSTRAP_FAILED),
        ("applied", APPLIED), ("timings", BOOTSTRAP_TIMINGS), ("install_timings", INSTALL_TIMINGS),
        ("release_env", RELEASE_ENV_PATH), ("installer", INSTALLER_PATH), ("reported", BOOT_FAILURE_REPORTED),
        ("cloud_log", CLOUD_INIT_LOG), ("cloud_status", CLOUD_INIT_STATUS), ("cloud_result", CLOUD_INIT_RESULT),
        ("daemon", DOCKER_DAEMON_JSON))}


def _common(at: dict[str, str], *, boot: bool) -> list[str]:
    """say and fail; fail shows the ends of the node's logs, so `pulumi up` says why, not just that
    (cloud-init's own output only for the first boot: later it holds nothing of an upgrade)."""
    cloud = [f"  echo '--- last 15 lines of {CLOUD_INIT_LOG} ---' >&2; tail -n 15 {at['cloud_log']} >&2 2>/dev/null "
             "|| true"] if boot else []
    return [
        "set -o pipefail",
        'say() { echo "gpu-swarm: $*" >&2; }',
        "fail() {",
        '  say "$1"',
        f"  echo '--- last 40 lines of {BOOTSTRAP_LOG} ---' >&2; tail -n 40 {at['log']} >&2 2>/dev/null || true",
        *cloud,
        "  exit 1",
        "}",
    ]


def _run_installer(at: dict[str, str], timeout_s: int) -> list[str]:
    """Run the installer as a transient unit and follow its log: if the SSH session drops, the
    install goes on, and the next `pulumi up` waits for it instead of starting another."""
    minutes = timeout_s // 60
    return [
        f"unit={INSTALL_UNIT}",
        f"mkdir -p \"$(dirname {at['log']})\" && touch {at['log']}",
        f"lines=$(wc -l <{at['log']})",
        'if systemctl is-active -q "$unit"; then say "an install is already running; waiting for it"',
        "else",
        '  systemctl reset-failed "$unit" >/dev/null 2>&1 || true',
        f'  systemd-run --unit "$unit" --collect --quiet {at["installer"]}',
        "fi",
        f"end=$(( $(date +%s) + {int(timeout_s)} ))",
        'while systemctl is-active -q "$unit"; do',
        f"  tail -n +$((lines + 1)) {at['log']} | sed 's/^/  | /' >&2",
        f"  lines=$(wc -l <{at['log']})",
        f'  [ "$(date +%s)" -lt "$end" ] || fail "the install is still running after {minutes} min; it goes on'
        f' (journalctl -u $unit): run pulumi up again to wait for it"',
        "  sleep 5",
        "done",
        f"tail -n +$((lines + 1)) {at['log']} | sed 's/^/  | /' >&2",
    ]


def _outcome(at: dict[str, str], what: str) -> list[str]:
    return [
        f'if [ -e {at["failed"]} ]; then fail "{what}: step $(cat {at["failed"]}) failed; '
        'its steps are idempotent, and the next pulumi up retries it"; fi',
        f'[ -e {at["done"]} ] || fail "{what}: the install ended without finishing (journalctl -u {INSTALL_UNIT})"',
    ]


def _advertised_gpus(env: dict[str, str], gpus: int, daemon_json: str) -> list[str]:
    # dockerd reads node-generic-resources only at start, and the agent restarts it after
    # writing them, so daemon.json is what the engine advertises: each GPU whole, or as
    # GPU_SWARM_SLOTS_PER_GPU slots of the shared kind.
    kind, slots = env.get(KIND_ENV, ""), int(env.get(SLOTS_PER_GPU_ENV) or 0)
    if not kind or not gpus:
        return []
    kind = validate_kind(env[SHARED_KIND_ENV] if slots else kind)
    expected = gpus * (slots or 1)
    return [
        f"n=$({{ grep -o {quote(chr(34) + kind + '=')} {daemon_json} 2>/dev/null || true; }} | wc -l)",
        f'[ "$n" -eq {int(expected)} ] || fail "node advertises $n {kind} resources in {daemon_json},'
        f' expected {int(expected)}"',
    ]


RELEASE_LINE = "release "  # then the id: the line wait_for_boot and boot_recorded print before the timings


def _release_line(at: dict[str, str]) -> list[str]:
    # The release the node runs (the installer writes it once it is applied), for the program to
    # know that a node it has just seen boot needs no drain and no upgrade (components/node_rollout.py).
    return [f'printf \'{RELEASE_LINE}%s\\n\' "$(cat {at["applied"]} 2>/dev/null || true)"']


def ran_release(stdout: str) -> str | None:
    """The release id that wait_for_boot or boot_recorded printed: what the node ran then; None if none."""
    for line in (stdout or "").splitlines():
        if line.startswith(RELEASE_LINE) and line[len(RELEASE_LINE):].strip():
            return line[len(RELEASE_LINE):].strip()
    return None


def _timings(at: dict[str, str], *, first_boot: bool = False) -> list[str]:
    """Print one JSON object: each install step's seconds and status, and cloud-init's whole boot;
    first_boot: and say so if cloud-init reported errors (once: later runs read the same boot)."""
    return [
        f"python3 - {at['install_timings']} {at['timings']} {at['cloud_status']} <<'PY'",
        "import json, sys",
        "out = {}",
        "for path in sys.argv[1:3]:",
        "    try:",
        "        out.update(json.load(open(path)))",
        "    except (OSError, ValueError):",
        "        pass",
        "try:",
        "    v1 = json.load(open(sys.argv[3]))['v1']",
        "    start = v1['init-local']['start'] or v1['init']['start']",
        "    end = v1['modules-final']['finished']",
        "    if start and end:",
        "        failed = any(v1[s]['errors'] for s in ('init-local', 'init', 'modules-config', 'modules-final'))",
        "        out['cloud-init'] = {'seconds': round(end - start, 3), 'status': 'failed' if failed else 'done'}",
        # The install's own markers decided above: this only says so.
        *(["        if failed:", "            print('gpu-swarm: cloud-init reported errors (cloud-init status --long)', "
           "file=sys.stderr)"] if first_boot else []),
        "except (OSError, ValueError, KeyError, TypeError):",
        "    pass",
        "print(json.dumps(out))",
        "PY",
    ]


def wait_for_boot(*, env: dict[str, str], expected_gpus: int, timeout_s: int = 2700,
                  install_timeout_s: int = 2700, root: str = "", ask_every_s: int = 30) -> str:
    """On a new node: wait until its first boot (cloud-init and the install it runs) has ended.

    It waits for nothing that the boot itself does not bring. A failed boot fails with the
    ends of the node's logs; the next run of this script (the next `pulumi up`) installs
    again. Prints the boot's timings as JSON.
    """
    at = _paths(root)
    minutes = timeout_s // 60
    return script(
        *_common(at, boot=True),
        "command -v cloud-init >/dev/null 2>&1 || fail 'this image has no cloud-init, which installs gpu-swarm at "
        "first boot: use Ubuntu 24.04, the Deep Learning AMI, or an image built from them'",
        # cloud-init writes result.json when its last stage ends. Polled here, not with `cloud-init status
        # --wait`: that Python process polls every 0.25 s and sleeps once more after it sees the end, so it
        # returned 0.3-0.5 s late, and its polls took the CPU of the boot it waited for. Every ask_every_s
        # this asks cloud-init itself, for a boot that will never write the file (cloud-init disabled, or
        # crashed). Not more often: one `cloud-init status` took 0.3-0.65 CPU-s of the boot it waited for.
        f"end=$((SECONDS + {int(timeout_s)})); ask=$((SECONDS + {int(ask_every_s)}))",
        f"until [ -e {at['cloud_result']} ]; do",
        '  if [ "$SECONDS" -ge "$ask" ]; then',
        f"    ask=$((SECONDS + {int(ask_every_s)}))",
        '    case $(cloud-init status 2>/dev/null) in *"status: running"* | *"status: not started"*) ;; *) break ;; esac',
        "  fi",
        f'  [ "$SECONDS" -lt "$end" ] || fail "the first boot is still running after {minutes} min (cloud-init status --long)"',
        "  sleep 0.1",
        "done",
        f'if [ -e {at["failed"]} ] && [ -e {at["reported"]} ]; then',
        '  say "retrying the install that failed at first boot"',
        *(f"  {line}" for line in _run_installer(at, install_timeout_s)),
        "fi",
        f'if [ -e {at["failed"]} ]; then touch {at["reported"]}; fi',
        f'[ -e {at["done"]} ] || [ -e {at["failed"]} ] || fail "cloud-init ended, but the gpu-swarm install never ran '
        f'(the user data was not applied; see {CLOUD_INIT_LOG})"',
        *_outcome(at, "the first boot failed"),
        f"rm -f {at['reported']}",
        *_advertised_gpus(env, expected_gpus, at["daemon"]),
        *_release_line(at),
        *_timings(at, first_boot=True),
    )


def boot_recorded(root: str = "") -> str:
    """A booted node's boot wait, run again (an update: a new connection, new settings): it has nothing to wait
    for, so it only prints the first boot's timings again. Later changes are the rollout's (upgrade)."""
    at = _paths(root)
    return script(
        *_common(at, boot=False),
        f'[ -e {at["done"]} ] || [ -e {at["failed"]} ] || fail "this node has no record of its first boot"',
        'say "booted already; changes reach it through its rollout"',
        *_release_line(at),
        *_timings(at),
    )


def upgrade(new: NodeRelease, *, expected_gpus: int, timeout_s: int = 2700, root: str = "") -> str:
    """Bring a running node to `new` in place: the files its boot wrote, then the installer its boot ran.

    A node that already runs `new` (it booted with it) only says so. Prints the timings.
    """
    at = _paths(root)
    writes = []
    for n, f in enumerate(new.files()):
        mark = f"GPU_SWARM_FILE_{n}"
        if mark in f.content or not f.content.endswith("\n"):
            raise ValueError(f"{f.path}: content must end with a newline and not contain {mark}")
        path = quote(root + f.path)
        writes += [f'mkdir -p "$(dirname {path})"',
                   f"cat >{path}.new <<'{mark}'\n{f.content}{mark}",
                   f"chmod {f.mode} {path}.new && mv {path}.new {path}"]
    return script(
        *_common(at, boot=False),
        *writes,
        f'if [ "$(cat {at["applied"]} 2>/dev/null || true)" = {new.id} ] && [ -e {at["done"]} ]; then',
        f'  say "this node runs release {new.id[:12]}"',
        "else",
        *(f"  {line}" for line in _run_installer(at, timeout_s)),
        *(f"  {line}" for line in _outcome(at, "the upgrade failed")),
        "fi",
        *_advertised_gpus(new.env, expected_gpus, at["daemon"]),
        "docker info >/dev/null 2>&1 || fail 'docker is not running'",
        *_timings(at),
    )


def health_settings(env: dict[str, str], root: str = "", price: dict[str, str] | None = None) -> str:
    """On the node, as root: write health.env and restart the health services that run, if it changed; and on a
    GPU node its price (price_settings), which restarts nothing.

    Prints "changed" or "unchanged" for health.env, last. The services read it at start; one not installed
    yet (a node still in its first boot) starts with it later.
    """
    path = quote(root + HEALTH_ENV_PATH)
    return script(
        f'mkdir -p "$(dirname {path})"',
        *([] if price is None else _price_lines(price, root)),
        f"cat >{path}.new <<'HEALTH_ENV'\n{env_text(env)}HEALTH_ENV",
        f"if cmp -s {path}.new {path}; then rm -f {path}.new; echo unchanged; exit 0; fi",
        f"mv {path}.new {path}",
        # A manager has no watcher, a GPU node no reconciler; try-restart leaves a stopped one stopped.
        f"for unit in {' '.join(HEALTH_UNITS)}; do",
        '  if systemctl cat "$unit" >/dev/null 2>&1; then systemctl try-restart "$unit"; fi',
        "done",
        "echo changed",
    )


def price_settings(price: dict[str, str], root: str = "") -> str:
    """On a GPU node, as root: write cost.env (to_node/software.py price_env), if it changed. The metrics exporter
    reads it again when it changes, so a new price (spot's move every day) restarts nothing.

    Prints "price changed" or "price unchanged"."""
    return script(f'mkdir -p "$(dirname {quote(root + COST_ENV_PATH)})"', *_price_lines(price, root))


def _price_lines(price: dict[str, str], root: str) -> list[str]:
    cost = quote(root + COST_ENV_PATH)
    return [f"cat >{cost}.new <<'COST_ENV'\n{env_text(price)}COST_ENV",
            f"if cmp -s {cost}.new {cost}; then rm -f {cost}.new; echo price unchanged; "
            f"else mv {cost}.new {cost}; echo price changed; fi"]


def autoscale_settings(files: dict[str, str], root: str = "") -> str:
    """On a manager, as root: make AUTOSCALE_DIR hold exactly `files` (name -> content: pools.json and each
    elastic pool's admit script). The scaler reads them at each round, so nothing restarts; a file of a pool
    the program no longer has goes. Contents travel base64-encoded: an admit script holds heredocs of its own.
    Prints "changed" or "unchanged"."""
    import base64
    import re

    folder = quote(root + AUTOSCALE_DIR)
    lines = [f"mkdir -p {folder}", f"chmod 0755 {folder}", "changed=''", "keep=' '"]
    for name, content in sorted(files.items()):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name):
            raise ValueError(f"autoscale file name {name!r}: use lowercase letters, digits, '.' and '-'")
        mode = "0755" if name.endswith(".sh") else "0644"
        encoded = base64.b64encode(content.encode()).decode()
        lines += [f"printf '%s' {encoded} | base64 -d >{folder}/.{name}.new",
                  f"if cmp -s {folder}/.{name}.new {folder}/{name}; then rm -f {folder}/.{name}.new; else "
                  f"chmod {mode} {folder}/.{name}.new; mv {folder}/.{name}.new {folder}/{name}; changed=1; fi",
                  f'keep="${{keep}}{name} "']
    lines += [f"for f in {folder}/*; do",
              '  [ -e "$f" ] || continue',
              '  case "$keep" in *" ${f##*/} "*) ;; *) rm -f "$f"; changed=1 ;; esac',
              "done",
              'if [ -n "$changed" ]; then echo changed; else echo unchanged; fi']
    return script(*lines)


def authorize_keys(user: str, keys: list[str]) -> str:
    """On the node, as root: make `keys` the only keys that may log in as `user`.

    The program owns the whole authorized_keys file. That is what lets it rotate its own
    key: first add the new key (sshAuthorizedKeys), then switch to it and drop the old one.
    """
    if not LINUX_USER_RE.fullmatch(user or ""):
        raise ValueError(f"{user!r} is not a Linux user name")
    keys = [k.strip() for k in keys]
    if not keys:
        raise ValueError("at least one public key must stay authorized, or nobody can log in again")
    for k in keys:
        problem = public_key_problem(k)
        if problem:
            raise ValueError(f"{k[:40]!r}...: {problem}")
    body = "".join(f"{k}\n" for k in dict.fromkeys(keys))
    return script(
        f"home=$(getent passwd {user} | cut -d: -f6)",
        f'[ -n "$home" ] || {{ echo "gpu-swarm: there is no user {user} on this node" >&2; exit 1; }}',
        f'install -d -m 0700 -o {user} -g "$(id -gn {user})" "$home/.ssh"',
        "tmp=$home/.ssh/authorized_keys.gpu-swarm",
        f"cat >\"$tmp\" <<'KEYS'\n{body}KEYS",
        f'chown {user}:"$(id -gn {user})" "$tmp" && chmod 0600 "$tmp"',
        'mv -f "$tmp" "$home/.ssh/authorized_keys"',
        f'echo "{len(dict.fromkeys(keys))} key(s) may log in as {user}"',
    )
