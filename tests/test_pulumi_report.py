"""The rehearsal's report after the real `pulumi up` (localswarm/pulumi_report.py), from outputs of the shape the
program exports."""
from localswarm import pulumi_report

OUTPUTS = {
    "inventory": [
        {"name": "c-manager-0", "role": "manager", "pool": "managers", "gpusAdvertised": [], "gpusExpected": 0,
         "gpusVerified": None, "health": {"state": "ready", "availability": "active"}},
        {"name": "c-t4-0", "role": "worker", "pool": "t4", "gpusAdvertised": ["GPU-1"], "gpusExpected": 2,
         "gpusVerified": False, "health": {"state": "down", "availability": "drain"}},
    ],
    "stackTasks": {"smoke": {"services": {"smoke_gpu": "1 running, 1 waiting for resources"},
                             "waitingForGpus": [{"service": "smoke_gpu", "task": 2, "reason": "insufficient"}]}},
    "bootstrapTimings": {"c-t4-0": {"cloud-init": {"seconds": 3.5, "status": "done"}}},
    "cost": {"table": ["POOL ...", "TOTAL 2 0.5676"]},
}


def test_each_node_with_what_it_advertises_and_whether_its_gpus_were_proven():
    lines = pulumi_report.render(OUTPUTS)
    assert lines[0].split() == ["NODE", "ROLE", "POOL", "STATE", "AVAILABILITY", "GPUS", "PROVEN"]
    assert lines[1].split() == ["c-manager-0", "manager", "managers", "ready", "active", "0/0", "-"]
    assert lines[2].split() == ["c-t4-0", "worker", "t4", "down", "drain", "1/2", "NO"]


def test_the_stacks_their_waiting_tasks_the_boot_and_the_cost():
    text = "\n".join(pulumi_report.render(OUTPUTS))
    assert "stack smoke: smoke_gpu: 1 running, 1 waiting for resources" in text
    assert "  smoke_gpu task 2 waits: insufficient" in text
    assert "  c-t4-0: cloud-init 3.5 s (done)" in text
    assert text.endswith("TOTAL 2 0.5676")


def test_an_up_that_exported_nothing_yet_reports_an_empty_table():
    assert pulumi_report.render({}) == ["NODE  ROLE  POOL  STATE  AVAILABILITY  GPUS  PROVEN", ""]
