"""The rehearsal's status table and `status --watch`, from views as placement.collect builds them
(no engine needed: the integration tests build real ones)."""
from __future__ import annotations

import pytest

from localswarm import __main__ as cli_main
from localswarm.placement import render_table
from localswarm.task_runs import converged

GPU = ["GPU-0a0a0a0a-0000-4000-8000-000000000001", "GPU-0a0a0a0a-0000-4000-8000-000000000002"]


def _node(name: str, **extra) -> dict:
    return {"name": name, "id": name + "-id", "role": "worker", "address": "", "state": "ready",
            "availability": "active", "condition": "healthy", "condition_reason": "ok", "condition_gpu": "-",
            "health": "", "health_last": "", "drained_by": "", "maintenance": "", "gpus": [], "slots": [], **extra}


def _row(table: str, start: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(start))


def test_a_node_drained_for_its_health_says_why_and_its_gpus_are_not_free():
    view = {"nodes": [_node("node-1", gpus=[GPU[0]]),
                      _node("node-2", gpus=[GPU[1]], availability="drain", drained_by="health",
                            condition="unhealthy", condition_reason=f"xid_79_on_{GPU[1]}", condition_gpu=GPU[1])],
            "services": []}
    table = render_table(view)
    assert "CONDITION" in _row(table, "NODE ")
    row = _row(table, "node-2  ")
    assert "drain (health)" in row and f"unhealthy: xid_79_on_{GPU[1]}" in row
    assert "unusable (node drain)" in _row(table, f"node-2  {GPU[1]}")
    assert _row(table, f"node-1  {GPU[0]}").split()[-1] == "free"
    assert "healthy" in _row(table, "node-1  ") and ": ok" not in table  # a healthy node's reason is noise


def test_a_node_without_a_watcher_report_is_unknown_and_a_down_nodes_gpus_unusable():
    view = {"nodes": [_node("node-1", gpus=[GPU[0]], condition="unknown", state="down")], "services": []}
    table = render_table(view)
    assert _row(table, "node-1  ").split()[2:5] == ["down", "active", "unknown"]
    assert "unusable (node down)" in _row(table, f"node-1  {GPU[0]}")


def test_converged_waits_for_missing_replicas_and_unexplained_pending_tasks():
    task = {"state": "running", "reason": ""}
    assert converged({"services": [{"replicas": 2, "tasks": [task, {"state": "pending", "reason": "no node"}]}]})
    assert not converged({"services": [{"replicas": 2, "tasks": [task]}]})
    assert not converged({"services": [{"replicas": 1, "tasks": [{"state": "pending", "reason": ""}]}]})


def test_status_watch_redraws_until_ctrl_c_and_shows_errors_in_place(monkeypatch, capsys):
    views = iter([{"nodes": [_node("node-1")], "services": []}, cli_main.RehearsalError("no rehearsal is up")])

    def status(progress):
        item = next(views)
        if isinstance(item, Exception):
            raise item
        return item

    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_main.rehearsal, "status", status)
    monkeypatch.setattr(cli_main.time, "sleep", sleep)
    assert cli_main.main(["status", "--watch", "--interval", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("\033[H\033[2J") == 2 and "every 0.5s, Ctrl-C to stop" in out
    assert "node-1" in out and "localswarm: no rehearsal is up" in out
    assert sleeps == [0.5, 0.5]


@pytest.mark.parametrize("argv, error", [
    (["node", "gpu-fault", "node-2", "--xid", "x"], "invalid int value"),
    (["node", "explode", "node-2"], "invalid choice"),
])
def test_node_health_commands_refuse_bad_arguments(argv, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main.main(argv)
    assert exit_.value.code == 2 and error in capsys.readouterr().err


def test_the_drain_watcher_counts_only_nodes_the_run_took_out_of_service(monkeypatch):
    """A roll's cordon drains a node it saw active: counted. An operator's drain from before the run, and a
    new node that joins drained until its admit, never served in it: not counted."""
    from localswarm import placement

    def info(node_id: str, availability: str, pool: str | None = "t4") -> dict:
        return {"ID": node_id, "Spec": {"Availability": availability,
                                        "Labels": {placement.POOL_LABEL: pool} if pool else {}}}
    looks = iter([
        [info("old-1", "active"), info("old-2", "active"), info("kept-out", "drain")],
        [info("old-1", "drain"), info("old-2", "active"), info("kept-out", "drain"), info("new-1", "drain", None)],
        [info("old-1", "drain"), info("old-2", "active"), info("kept-out", "drain"), info("new-1", "drain")],
        [info("old-2", "drain"), info("kept-out", "drain"), info("new-1", "active")],
    ])
    def get(sock, path, timeout):
        try:
            return next(looks)
        except StopIteration:
            watcher._done.set()
            return []
    monkeypatch.setattr(placement.api, "get", get)
    watcher = placement.DrainWatcher(lambda: [type("Manager", (), {"role": "manager", "sock": "s"})()])
    monkeypatch.setattr(watcher._done, "wait", lambda s: watcher._done.is_set())
    watcher.run()
    assert watcher.peak == {"t4": 1}, watcher.peak


def test_a_failed_runs_diagnostics_say_when_no_machine_holds_the_address_it_dialled(monkeypatch):
    """tests/rehearsal_tools.machines_named: an Elastic IP's address is no machine's own, so each machine's
    interface is read; an address that none holds is said as such, not passed over."""
    from tests import rehearsal_tools
    monkeypatch.setattr(rehearsal_tools.machines, "machines", lambda: [])
    said = rehearsal_tools.machines_named("error: dial 192.168.215.201: failed 121 times: ... port 22: "
                                          "Connection refused\nssh: dial 192.168.215.15:22 again")
    assert said == "\n--- no machine holds 192.168.215.15, 192.168.215.201 now"
