"""Proving a node's GPUs after it joins: what a task can really use, not what the node advertises.

Run on a manager as part of admitting a GPU node. Two one-shot jobs are pinned to the node,
through the same scheduler, runtime guard and NVIDIA runtime as every task:
- one reserves all of the node's GPUs (one slot, on a node that shares its GPUs) and must
  see exactly the GPUs the node advertises (the slot's GPU);
- one reserves nothing, on an image that asks for every GPU (NVIDIA_VISIBLE_DEVICES=all,
  as every CUDA image does), and must see none.
A node that fails is drained (drained-by=gpu-check, which admit undoes once it passes) and
the check exits 1 with the evidence, so `pulumi up` fails for that node. It drains only on
evidence: when other tasks hold the node's GPUs and the reserving job cannot start, that half
is skipped ("gpus_busy") and the node stays in, unverified (gpusVerified: null in the inventory output).
Nothing checks it again by itself: the node's next roll does (a new release), or, at once,
`pulumi up --replace` of its admit command (docs/stacks/isolation.md). The node's
tasks say so within a second ("busy_because": "held"); a job pending for another reason is
given busy_after_s. A job that completed but whose output never reached the manager is no
evidence either ("unread"): the node stays in, unverified, in the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

from swarm.gpu_kind import validate_kind
from swarm.labels import CHECK_SERVICE_LABEL, DRAINED_BY_GPU_CHECK, DRAINED_BY_LABEL, VERIFIED_LABEL
from swarm.node_contract import CHECK_IMAGE, GPU_HELD
from swarm.script import node_prefix, node_ref, quote

# CHECK_IMAGE is built on every GPU node by node/build-check-image.sh (busybox and the C
# library that the nvidia-smi the runtime mounts in needs). The .invalid domain never
# resolves, so a node can never pull someone else's image under this name: it always runs its own.

# What each job prints: its GPUs as nvidia-smi sees them, and its GPU device nodes.
PROBE = ("if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>&1 || true; fi; "
         "for d in /dev/nvidia[0-9]*; do if [ -e \"$d\" ]; then echo \"device $d\"; fi; done; echo probe-end")


@dataclass(frozen=True)
class GpuCheck:
    image: str = CHECK_IMAGE
    devices: bool = True  # real GPUs: each seen GPU has its /dev/nvidiaN (the rehearsal has none)
    shared_kind: str = ""  # set when the node advertises slots of shared GPUs
    timeout_s: int = 180
    busy_after_s: int = 30  # a reserving job still pending for GPUs after this: they are busy
    logs_wait_s: int = 20  # how long a finished job's output may take to reach the manager


def verify_gpus(node: str, *, kind: str, count: int, release: str, check: GpuCheck, units: int = 0) -> list[str]:
    """Lines for admit_node: prove the node's GPUs unless this release already did; drain it if not.
    units: what the node advertises of the kind it checks (its GPUs, or its slots); default count."""
    node = node_ref(node)
    kind = validate_kind(check.shared_kind or kind)
    reserve = 1 if check.shared_kind else count
    # The reserving job cannot start while other tasks hold more than this of the node's units.
    spare = (units or count) - reserve
    jobs = f"gpu-swarm-check-{node_prefix(node)}"
    common = (f"--detach --mode replicated-job --restart-condition none --no-resolve-image "
              f"--constraint node.id=={node} --label {CHECK_SERVICE_LABEL}={node}")
    probe = quote(PROBE)
    expect = "the slot's GPU" if check.shared_kind else f"all {count} GPUs the node advertises"
    return [
        f"verified=$(node_label {node} {VERIFIED_LABEL})",
        f'if [ "$verified" = {release} ]; then',
        '  check=\'{"verified": true, "note": "verified before, same software"}\'',
        f"elif [ \"$(docker node inspect --format '{{{{.Spec.Availability}}}}' {node})\" != active ]; then",
        '  check=\'{"verified": false, "note": "not checked: an operator keeps the node out of scheduling"}\'',
        "else",
        f'  jobs={jobs}',
        '  cleanup() { docker service rm "$jobs-reserved" "$jobs-none" >/dev/null 2>&1 || true; }',
        "  cleanup; trap cleanup EXIT",
        f'  docker service create {common} --name "$jobs-reserved" --generic-resource {quote(f"{kind}={reserve}")} '
        f"{quote(check.image)} sh -c {probe} >/dev/null",
        f'  docker service create {common} --name "$jobs-none" {quote(check.image)} sh -c {probe} >/dev/null',
        # Both jobs' states in one `docker service ps` a round, and the clock from bash: every GPU node's
        # admission polls at once, and their processes took the CPU the jobs themselves needed.
        "  poll() {",
        '    local services=("$jobs-none"); "$busy" || services+=("$jobs-reserved")',
        '    none_state=""; reserved_state=""',
        "    while read -r task state _; do",
        '      case $task in "$jobs-none".*) none_state=${none_state:-$state} ;; '
        '"$jobs-reserved".*) reserved_state=${reserved_state:-$state} ;; esac',
        "    done < <(docker service ps --format '{{.Name}} {{.CurrentState}}' \"${services[@]}\" 2>/dev/null || true)",
        "  }",
        "  ended() { case $1 in Complete|Failed|Rejected) true ;; *) false ;; esac; }",
        # A roll gives the node back before this check, and tasks that waited for GPUs take them at
        # once: then the reserving job stays pending. The node's tasks say so within a second, where
        # waiting out busy_after_s cost every wave of a busy pool that long.
        "  held() {",
        f"    local ids; ids=$(docker node ps {node} -q --filter desired-state=running 2>/dev/null || true)",
        '    if [ -z "$ids" ]; then echo 0; return; fi',
        "    # shellcheck disable=SC2086 # one task ID a word",
        # A task's assigned resources: GenericResources, absent (so `index`, not a field) when it has none.
        "    { docker inspect --type task --format '{{json (index . \"GenericResources\")}}' $ids 2>/dev/null || true; } |",
        f"      grep -o {quote(chr(34) + 'Kind' + chr(34) + ':' + chr(34) + kind + chr(34))} | wc -l",
        "  }",
        # A check that never ends says where its job stopped, and what swarm makes of the node (a node
        # that swarm has down takes no task, even while its engine answers).
        "  stuck() {",
        "    local task state",
        "    task=$(docker service ps --no-trunc --format '{{.CurrentState}} {{.Error}}' \"$jobs-none\" 2>&1 | head -n 1)",
        # Its availability and labels too: a node drained while its check ran (by its health watcher's
        # reconciler, say) takes no task, and says who drained it and why.
        f"    state=$(docker node inspect --format '{{{{.Status.State}}}}{{{{with .Status.Message}}}} ({{{{.}}}}){{{{end}}}}, "
        f"{{{{.Spec.Availability}}}}, labels {{{{json .Spec.Labels}}}}' {node} 2>&1)",
        f'    echo "gpu-swarm: the GPU check jobs on node {node} did not finish in {int(check.timeout_s)} s: the job '
        'that reserves nothing is ${task:-not a task yet}, and swarm has the node ${state}; see docker service ps '
        '$jobs-none" >&2',
        "  }",
        f"  busy=false; busy_at=$((SECONDS + {int(check.busy_after_s)})); end=$((SECONDS + {int(check.timeout_s)}))",
        f"  probe_at=$SECONDS; why='still pending after {int(check.busy_after_s)} s'; left=''; out_at=$((SECONDS + 2))",
        '  until poll; ended "$none_state" && { "$busy" || ended "$reserved_state"; }; do',
        # The job that reserves nothing starts on any active node. Pending, it may be because the node
        # left scheduling while checked (its health watcher drained it, say): then no job of the check
        # will start, and waiting out timeout_s only to fail would blame the check.
        '    if [ "$none_state" = Pending ] && [ "$SECONDS" -ge "$out_at" ]; then',
        "      out_at=$((SECONDS + 2))",
        f"      if [ \"$(docker node inspect --format '{{{{.Spec.Availability}}}}' {node})\" != active ]; then left=1; break; fi",
        "    fi",
        '    if ! "$busy" && [ "$reserved_state" = Pending ] && [ "$SECONDS" -ge "$probe_at" ]; then',
        f'      probe_at=$((SECONDS + 1)); if [ "$(held)" -gt {int(spare)} ]; then busy_at=$SECONDS; why=held; fi',
        "    fi",
        '    if ! "$busy" && [ "$SECONDS" -ge "$busy_at" ] && [ "$reserved_state" = Pending ]; then',
        '      busy=true; docker service rm "$jobs-reserved" >/dev/null  # its GPUs are in use: skip that half',
        "    fi",
        '    [ "$SECONDS" -lt "$end" ] || { stuck; exit 1; }',
        "    sleep 0.25",
        "  done",
        '  if [ -n "$left" ]; then',
        "  cleanup",
        f"  labels=$(docker node inspect --format '{{{{json .Spec.Labels}}}}' {node})",
        f'  echo "gpu-swarm: node {node} was taken out of scheduling while its GPU check ran, so it was not '
        'checked, and it stays as whoever drained it left it: its labels are $labels" >&2',
        '  check=$(printf \'{"verified": null, "note": "not checked: taken out of scheduling while checked", '
        '"labels": %s}\' "${labels:-null}")',
        "  else",
        # A job's whole output ends with probe-end. `docker service logs` can answer before the node has
        # sent what a task that just ended printed, so a job that completed ($2) is asked again, for up
        # to logs_wait_s, before an output without probe-end counts. A job that failed is asked once:
        # one that never ran (the guard refused it) prints nothing, and its state and error say why.
        "  output() {",
        f'    local out tries=0 limit=0; [ "$2" != Complete ] || limit={4 * int(check.logs_wait_s)}',
        '    until out=$(docker service logs --raw "$1" 2>&1); [[ $out == *probe-end* ]] || '
        '[ "$tries" -ge "$limit" ]; do',
        "      tries=$((tries + 1)); sleep 0.25",
        "    done",
        '    printf \'%s\\n\' "$out"',
        '    if [[ $out != *probe-end* ]]; then',
        '      docker service ps --no-trunc --format \'(task {{.CurrentState}} {{.Error}})\' "$1" 2>&1 | head -n 1 || true',
        "    fi",
        "  }",
        '  reserved=""; if ! "$busy"; then reserved=$(output "$jobs-reserved" "$reserved_state"); fi',
        '  none=$(output "$jobs-none" "$none_state")',
        f"  want=$(docker node inspect {node} --format '{{{{json .Description.Resources.GenericResources}}}}')",
        "  check=$(python3 - \"$reserved\" \"$none\" \"$want\" \"$busy\" \"$why\" <<'PY'",
        *judge(kind, check, reserve).splitlines(),
        "PY",
        "  )",
        "  cleanup",
        '  if printf \'%s\' "$check" | grep -q \'"verified": true\'; then',
        f"    docker node update --label-add {VERIFIED_LABEL}={release} {node} >/dev/null",
        '  elif printf \'%s\' "$check" | grep -q \'"verified": null\'; then',
        '    if printf \'%s\' "$check" | grep -q \'"unread": \\[\\]\'; then',
        f'      echo "gpu-swarm: node {node}: its GPUs are busy, so only the unreserved half of the GPU check ran; '
        'it passed. It stays in, unverified: its next roll checks it again, or pulumi up --replace of its admit '
        'command now" >&2',
        "    else",
        f'      echo "gpu-swarm: node {node}: a GPU check job completed, but its output never reached this manager '
        f'(docker service logs, {int(check.logs_wait_s)} s), so the node is not verified. That is no evidence '
        'against it: it stays in, unverified: its next roll checks it again, or pulumi up --replace of its admit '
        'command now. Evidence:" >&2',
        '      printf \'%s\\n\' "$check" >&2',
        "    fi",
        "  else",
        f"    docker node update --availability drain --label-add {DRAINED_BY_LABEL}={DRAINED_BY_GPU_CHECK} {node} "
        ">/dev/null",
        f'    echo "gpu-swarm: node {node} failed its GPU check, so it was drained: a task reserving {expect} '
        'must see exactly those, and a task reserving none must see none. Evidence:" >&2',
        '    printf \'%s\\n\' "$check" >&2',
        "    printf '{\"resources\": %s, \"check\": %s}\\n' \"${res:-null}\" \"$check\"",
        "    exit 1",
        "  fi",
        "  fi",
        "fi",
    ]


def judge(kind: str, check: GpuCheck, reserve: int) -> str:
    """The comparison, in the manager's Python (Ubuntu's, stdlib): kept beside the lines that feed it."""
    return f'''import json, re, sys
uuid = re.compile(r"UUID: ((?:GPU|MIG)-[0-9a-fA-F-]+[0-9a-fA-F](?:/[0-9]+/[0-9]+)?)")
def seen(log):
    # Every "GPU n: ..." line is a GPU the task can use: by its UUID, or as printed.
    gpus = set()
    for line in log.splitlines():
        if re.match(r"(GPU|MIG) [0-9]+", line):
            found = uuid.search(line)
            gpus.add(found.group(1) if found else line.strip())
    return sorted(gpus), sum(1 for l in log.splitlines() if l.startswith("device /dev/nvidia"))
reserved, none, want = sys.argv[1], sys.argv[2], json.loads(sys.argv[3] or "null") or []
busy = sys.argv[4] == "true"
# Why the reserving half was skipped: other tasks on the node held the GPUs ("held"), or it stayed pending.
why = sys.argv[5] if busy and len(sys.argv) > 5 else None
# Swarm gave the job a GPU that a container still runs on, and the runtime guard refused it: the GPU is
# busy, as the guard says, and that is no evidence about what a task of this node can see.
holder = re.search(r"{GPU_HELD} ([0-9a-f]+)", reserved) if "probe-end" not in reserved else None
if holder and not busy:
    busy, why = True, f"the runtime guard refused the job: container {{holder.group(1)}} holds the GPU"
values = [e["NamedResourceSpec"]["Value"] for e in want if e.get("NamedResourceSpec", {{}}).get("Kind") == {kind!r}]
advertised = sorted(set(re.sub(r"-s[0-9]+$", "", v) for v in values))
got, got_devices = seen(reserved)
leak, leak_devices = seen(none)
devices = {check.devices!r}
if {bool(check.shared_kind)!r}:
    ok = len(got) == 1 and got[0] in advertised
else:
    ok = got == advertised and len(got) == {reserve}
# A probe that did not print its last line did not run to the end: what it printed proves nothing.
ok = ok and (not devices or got_devices == len(got)) and "probe-end" in reserved
leaked = bool(leak or leak_devices)
clean = not leaked and "probe-end" in none
# A job that completed printed probe-end last, so a completed job's output without it is output that never
# reached the manager (CI: `docker service logs` answered empty for 10 s after a roll): no evidence either way.
unread = [half for half, log in (("reserved", reserved), ("unreserved", none))
          if "probe-end" not in log and "(task Complete " in log]
# Busy GPUs are no evidence either way: then only the unreserved half counts, and only against.
if leaked:
    verified = False
elif unread:
    verified = None
else:
    verified = (None if clean else False) if busy else (ok and clean)
print(json.dumps({{"verified": verified, "gpus_busy": busy, "busy_because": why, "unread": unread, "expected": advertised, "reserved_saw": got, "reserved_devices": got_devices,
                  "unreserved_saw": leak, "unreserved_devices": leak_devices,
                  "evidence": {{"reserved": reserved[-600:], "unreserved": none[-600:]}}}}))'''
