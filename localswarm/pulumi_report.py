"""The rehearsal's report after the real `pulumi up`, read from the stack's real outputs.

What `pulumi stack output` holds is what the nodes printed to the program's commands (the
inventory from each node's admit and the health read, the stacks' tasks from their deploy,
the boot timings from cloud-init's log): the report adds nothing of the rehearsal's own.
"""
from __future__ import annotations


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(outputs: dict) -> list[str]:
    rows = [("NODE", "ROLE", "POOL", "STATE", "AVAILABILITY", "GPUS", "PROVEN")]
    for n in outputs.get("inventory") or []:
        health = n.get("health") or {}
        proven = {True: "yes", False: "NO"}.get(n.get("gpusVerified"), "-")
        rows.append((n["name"], n.get("role", ""), n.get("pool", ""), health.get("state") or "?",
                     health.get("availability") or "?", f"{len(n.get('gpusAdvertised') or [])}/{n.get('gpusExpected', 0)}",
                     proven))
    lines = _table(rows)
    lines.append("")
    for stack, tasks in sorted((outputs.get("stackTasks") or {}).items()):
        services = "; ".join(f"{name}: {state}" for name, state in sorted((tasks.get("services") or {}).items()))
        lines.append(f"stack {stack}: {services}")
        for waiting in tasks.get("waitingForGpus") or []:
            lines.append(f"  {waiting['service']} task {waiting['task']} waits: {waiting['reason']}")
    if outputs.get("bootstrapTimings"):
        lines.append("boot, each step of the user data as the node timed it:")
    for node, steps in sorted((outputs.get("bootstrapTimings") or {}).items()):
        shown = ", ".join(f"{step} {t.get('seconds')} s ({t.get('status')})" for step, t in steps.items())
        lines.append(f"  {node}: {shown}")
    table = (outputs.get("cost") or {}).get("table") or []
    if table:
        lines += ["", *table]
    return lines
