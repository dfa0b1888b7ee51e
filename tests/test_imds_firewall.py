"""IMDS for root only (node/imds-root-only.sh, the secure-imds step, gpu-swarm-imds.service), in real bash.

The rules are checked with the real iptables in a network namespace of their own (unshare -n,
so the machine's own rules are untouched): a metadata server at 169.254.169.254 answers root
and not the nobody user, and a second run changes nothing. A stub iptables, whose exit codes are
iptables' (1: no such chain or rule, or the chain exists; 2: a bad parameter or a missing match
module; 4: the xtables lock), shows how the script meets each of them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest

from node import contract
from tests.test_shell_scripts import NODE_SRC, Node

SCRIPT = NODE_SRC / "imds-root-only.sh"
UNIT = NODE_SRC / contract.IMDS_UNIT

# A stub of iptables' command line for what the script uses: one file per chain, one rule per line.
STUB = textwrap.dedent(r'''
    #!/usr/bin/env bash
    echo "iptables $*" >>"$FAKE_CALLS"
    [ -n "${IPT_LOCKED:-}" ] && { echo "Another app is currently holding the xtables lock. Stopped waiting after 10s." >&2; exit 4; }
    if [ "$1" = -w ]; then shift; [[ "${1:-}" =~ ^[0-9]+$ ]] && shift; fi
    [ "$1" = -n ] && shift
    op=$1 chain=$2; shift 2
    file="$IPT_STATE/$chain"
    rule="$*"
    if [ -n "${IPT_NO_OWNER:-}" ] && [[ "$rule" == *"-m owner"* ]]; then
      echo "iptables v1.8.9 (nf_tables): Couldn't load match \`owner':No such file or directory" >&2; exit 2
    fi
    case $op in
      -L) [ -f "$file" ] || { echo "iptables: No chain/target/match by that name." >&2; exit 1; }; cat "$file" ;;
      -N) [ -f "$file" ] && { echo "iptables: Chain already exists." >&2; exit 1; }; : >"$file" ;;
      -C) [ -f "$file" ] && grep -qxF -- "$rule" "$file" || { echo "iptables: Bad rule (does a matching rule exist in that chain?)." >&2; exit 1; } ;;
      -A) [ -f "$file" ] || exit 1; echo "$rule" >>"$file" ;;
      -I) [ -f "$file" ] || exit 1
          if [[ "$1" =~ ^[0-9]+$ ]]; then pos=$1; shift; rule="$*"; else pos=1; fi
          { head -n $((pos - 1)) "$file"; echo "$rule"; tail -n +"$pos" "$file"; } >"$file.new"; mv "$file.new" "$file" ;;
      *) echo "iptables v1.8.9 (nf_tables): unknown option \"$op\"" >&2; exit 2 ;;
    esac
''').lstrip()


@pytest.fixture
def stub(tmp_path) -> Node:
    node = Node(tmp_path)
    node.write(node.bin / "iptables", STUB)
    state = tmp_path / "iptables"
    state.mkdir()
    (state / "OUTPUT").write_text("-o lo -j ACCEPT\n")  # a rule the image already had
    node.env["IPT_STATE"] = str(state)
    return node


def run(node: Node, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env={**node.env, **env}, capture_output=True, text=True, timeout=30)


def chains(node: Node) -> dict[str, list[str]]:
    return {p.name: p.read_text().splitlines() for p in (node.root / "iptables").iterdir()}


def test_root_is_accepted_and_everyone_else_rejected_first_in_output(stub):
    result = run(stub)
    assert result.returncode == 0, result.stderr
    assert chains(stub) == {
        "OUTPUT": ["-d 169.254.169.254/32 -j GPU-SWARM-IMDS", "-o lo -j ACCEPT"],
        "GPU-SWARM-IMDS": ["-m owner --uid-owner 0 -j ACCEPT", "-j REJECT"],
    }
    assert "answers root only" in result.stdout


def test_a_second_run_only_checks(stub):
    run(stub)
    before = chains(stub)
    stub.calls.unlink()
    assert run(stub).returncode == 0
    assert chains(stub) == before
    assert stub.called() and all({"-L", "-C"} & set(call.split()) for call in stub.called()), stub.called()


def test_a_chain_left_half_made_gets_root_back_on_top(stub):
    (stub.root / "iptables" / "GPU-SWARM-IMDS").write_text("-j REJECT\n")
    assert run(stub).returncode == 0
    assert chains(stub)["GPU-SWARM-IMDS"] == ["-m owner --uid-owner 0 -j ACCEPT", "-j REJECT"]


@pytest.mark.parametrize("env,code,words", [
    ({"IPT_NO_OWNER": "1"}, 2, "Couldn't load match `owner'"),
    ({"IPT_LOCKED": "1"}, 4, "holding the xtables lock"),
])
def test_an_iptables_failure_fails_the_run_with_its_code_and_words(stub, env, code, words):
    result = run(stub, **env)
    assert result.returncode == code and words in result.stderr and f"(exit {code})" in result.stderr
    assert "-d 169.254.169.254/32 -j GPU-SWARM-IMDS" not in chains(stub)["OUTPUT"]  # no jump to a broken chain


@pytest.fixture
def imds(tmp_path):
    """EC2's metadata service as localswarm/fake_imds.py plays it for the rehearsal's machines, on loopback:
    set(options) makes it answer this host as an instance launched with those metadata options."""
    from http.server import ThreadingHTTPServer

    from localswarm import fake_imds
    records = tmp_path / "imds-records"
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake_imds.make_instance_handler(records))
    threading.Thread(target=server.serve_forever, daemon=True).start()

    class Imds:
        url = f"http://127.0.0.1:{server.server_address[1]}"

        @staticmethod
        def set(options: dict) -> None:
            fake_imds.register(records, "127.0.0.1", {"instance-id": "i-0abc", "user-data": "#cloud-config\n",
                                                      "metadataOptions": options})
    yield Imds
    server.shutdown()


def secure_imds(node: Node, imds_url: str) -> subprocess.CompletedProcess:
    node.real_step("secure-imds")
    node.fake("systemctl", "exit 0")
    node.env["GPU_SWARM_IMDS"] = imds_url
    return node.bootstrap("secure-imds")


def test_the_step_installs_enables_and_starts_the_unit_that_runs_the_script_at_each_boot(tmp_path, imds):
    node = Node(tmp_path)
    imds.set({"httpTokens": "required", "httpPutResponseHopLimit": 1})
    assert secure_imds(node, imds.url).returncode == 0, node.log.read_text()
    assert node.called() == [f"systemctl show -p LoadState --value {contract.IMDS_UNIT}",
                             "systemctl daemon-reload", f"systemctl restart {contract.IMDS_UNIT}",
                             f"systemctl enable --no-reload {contract.IMDS_UNIT}", "systemctl daemon-reload"]
    unit = (node.root / "units" / contract.IMDS_UNIT).read_text()
    assert f"ExecStart=/bin/bash {contract.IMDS_FIREWALL_PATH}\n" in unit
    assert "Type=oneshot" in unit and "Before=network-pre.target docker.service" in unit
    assert contract.IMDS_FIREWALL_PATH == f"{contract.SOFTWARE_DIR}/{SCRIPT.name}"


def test_a_node_launched_without_imdsv2_required_fails_its_first_step_and_says_why(tmp_path, imds):
    """The legacy spot request API dropped the metadata options: such a node answered IMDSv1."""
    node = Node(tmp_path)
    imds.set({"httpTokens": "optional", "httpPutResponseHopLimit": 1})
    result = secure_imds(node, imds.url)
    assert result.returncode != 0
    assert "answered a request without a token (IMDSv1)" in node.log.read_text()
    assert "http_tokens=required" in node.log.read_text()
    assert (node.state / "bootstrap-failed").read_text().strip() == "secure-imds"


def test_a_node_without_a_metadata_service_fails_its_first_step(tmp_path):
    node = Node(tmp_path)
    result = secure_imds(node, "http://127.0.0.1:9")  # nothing listens: connection refused
    assert result.returncode != 0 and "did not answer a request without a token" in node.log.read_text()


def test_every_node_secures_imds_first():
    from to_node import software as node_software
    for gpu, instance_type in ((False, "m7i.large"), (True, "g6e.12xlarge"), (True, "p5.48xlarge")):
        assert node_software.bootstrap_steps(gpu=gpu, instance_type=instance_type)[0] == "secure-imds"


# ---------------------------------------------------------------- real iptables, in a namespace of its own

REAL = r'''
set -euo pipefail
ip link set lo up
ip addr add 169.254.169.254/32 dev lo
python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("169.254.169.254", 8080)); s.listen(8)
while True:
    c, _ = s.accept(); c.sendall(b"user-data\n"); c.close()
' &
trap 'kill $!' EXIT
for _ in $(seq 50); do python3 -c 'import socket; socket.create_connection(("169.254.169.254", 8080), 1)' 2>/dev/null && break; sleep 0.1; done
bash "$SCRIPT" >/dev/null
get='import socket; print(socket.create_connection(("169.254.169.254", 8080), timeout=2).recv(64).decode().strip())'
echo "root: $(python3 -c "$get" 2>&1 | tail -1)"
echo "nobody: $(cd / && setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c "$get" 2>&1 | tail -1)"
first=$(iptables -S)
bash "$SCRIPT" >/dev/null
[ "$first" = "$(iptables -S)" ] && echo "again: unchanged"
'''


def test_with_real_iptables_the_metadata_address_answers_root_and_not_another_user(tmp_path):
    for tool in ("unshare", "iptables", "setpriv", "ip"):
        assert shutil.which(tool), f"{tool} is needed (util-linux, iptables, iproute2)"
    assert os.geteuid() == 0, "a network namespace of its own needs root here"
    script = tmp_path / "real.sh"
    script.write_text(REAL)
    result = subprocess.run(["unshare", "-n", "bash", str(script)], env={**os.environ, "SCRIPT": str(SCRIPT)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["root"] == "user-data"
    assert lines["nobody"] != "user-data" and ("timed out" in lines["nobody"] or "refused" in lines["nobody"])
    assert lines["again"] == "unchanged"
