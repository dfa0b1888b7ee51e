"""Spot nodes in both interruption modes: drained on AWS's notice, and given back when a stopped node resumes.

With `interruption: stop` AWS announces `"action": "stop"` two minutes ahead, stops the instance
and starts the same one (same EBS, same private address, same swarm node) when it has capacity
again; with `terminate` the instance is gone, and the next `pulumi up --refresh` makes a new one.
The watcher reads the notice from IMDSv2 (here the rehearsal's stand-in IMDS), the reconciler
on the leader drains on `reclaim` and gives the node back once its watcher says healthy again.
"""
from __future__ import annotations

import json
import secrets
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from localswarm.fake_imds import make_handler, notice_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import swarm_reconciler  # noqa: E402
from contract import CONDITION_LABEL, CONDITION_REASON_LABEL, DRAINED_BY_LABEL, HEALTH_LABEL  # noqa: E402
from health_sources import Imds  # noqa: E402


@pytest.fixture
def imds(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(tmp_path, secrets.token_hex(8)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}/node-1"
    server.shutdown()


def announce(root: Path, action: str) -> None:
    path = notice_file(root, "node-1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"action": action, "time": "2026-11-25T03:00:00Z"}))


@pytest.mark.parametrize("action", ["stop", "terminate"])
def test_the_watcher_reports_a_reclaim_in_both_modes(imds, action):
    root, base = imds
    spot = Imds(base, log=lambda m: None, spot=True)
    assert spot.poll(0.0) == ("healthy", "ok")
    announce(root, action)
    assert spot.poll(1.0) == ("reclaim", f"spot_{action}_at_2026-11-25T03:00:00Z")


def test_a_resumed_stop_node_is_healthy_at_its_watchers_first_check(imds):
    """After the stop, AWS starts the same instance: IMDS no longer announces anything."""
    root, base = imds
    announce(root, "stop")
    assert Imds(base, log=lambda m: None, spot=True).poll(0.0)[0] == "reclaim"
    notice_file(root, "node-1").unlink()  # the instance came back
    assert Imds(base, log=lambda m: None, spot=True).poll(100.0) == ("healthy", "ok")  # a fresh watcher, as after a boot


def node(condition: str, reason: str, availability: str = "active", labels: dict | None = None) -> dict:
    return {"ID": "n" * 25, "Spec": {"Availability": availability, "Labels": labels or {}},
            "Description": {"Hostname": "gpu-swarm-prod-inference-0",
                            "Engine": {"Labels": {CONDITION_LABEL: condition, CONDITION_REASON_LABEL: reason}}}}


def test_the_leader_drains_a_stop_notice_and_gives_the_node_back_when_it_resumes():
    (drain,) = swarm_reconciler.decide([node("reclaim", "spot_stop_at_2026-11-25T03:00:00Z")], True, 1000,
                                       max_drained_percent=1)  # reclaims are never held back
    assert drain.action == "drain" and "--availability" in drain.args and "drain" in drain.args
    drained = node("healthy", "ok", "drain", {DRAINED_BY_LABEL: "health",
                                             HEALTH_LABEL: "reclaim:spot_stop_at_2026-11-25T03:00:00Z"})
    (back,) = swarm_reconciler.decide([drained], True, 2000)
    assert back.action == "reactivate" and "active" in back.args
