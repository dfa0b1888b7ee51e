"""How the program's evaluation cost grows with the cluster: time and memory under Pulumi's mocks.

    .venv/bin/python bench/scale.py [--sizes 10 100 500] [--runs 3]

Each size runs in a fresh interpreter, so peak memory of one size does not hide another's.
It measures the Python side only (settings, components, every registration answered by the
mocks); with the real engine, provider calls and SSH commands add to it.

Beside each size it times the SDK's floor: a program with no logic of its own that replays the
program's registrations (same types, same input values as plain data, same dependencies)
through the same mocks. The ratio is what the program's own logic (settings, Output wiring,
rendering the scripts) costs on top of what Pulumi needs for those resources.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _config(gpu_nodes: int) -> dict:
    from tests.conftest import stack_config
    return stack_config(
        "prod",
        managerCount="3",
        gpuPools=[{"name": "gpu", "instanceType": "g6.xlarge", "count": gpu_nodes}],
        # prod's shared-GPU stack needs a sharing pool; one whole-GPU pool runs the smoke stack
        stacks=[{"name": "gpu-smoke", "file": "stacks/gpu-smoke.yml"}],
    )


def measure(gpu_nodes: int, trace: bool, types_out: str | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.conftest import run_program  # the test suite's mocks

    config = _config(gpu_nodes)
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    run = run_program(config, stack="bench")
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    assert len(run.exports["inventory"]) == gpu_nodes + 3
    if types_out:
        from tests.conftest import request_inputs, unwrap
        requests = [r for r in run.monitor.requests.values() if r.type != "pulumi:pulumi:Stack"]
        index = {r.name: i for i, r in enumerate(r for r in requests if r.custom)}
        Path(types_out).write_text(json.dumps([
            (r.type, r.custom, unwrap(request_inputs(r)) if r.custom else {},
             sorted({index[d.split("::")[-1]] for d in r.dependencies if d.split("::")[-1] in index}))
            for r in requests]))
    return {
        "gpu_nodes": gpu_nodes,
        "resources": len(run.monitor.requests),
        "seconds": seconds,
        "traced_peak_mib": peak / 2**20,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _sdk_classes() -> dict:
    """The SDK classes of the resource types the program registers, by type token."""
    import pulumi_aws as aws
    import pulumi_command as command
    import pulumi_tls as tls
    classes = [aws.ec2.Instance, aws.ec2.Vpc, aws.ec2.Subnet, aws.ec2.InternetGateway, aws.ec2.RouteTable,
               aws.ec2.RouteTableAssociation, aws.ec2.SecurityGroup, aws.ec2.KeyPair, aws.vpc.SecurityGroupIngressRule,
               aws.vpc.SecurityGroupEgressRule, command.remote.Command, command.remote.CopyToRemote, tls.PrivateKey]
    return {_token(cls): cls for cls in classes}


def _token(cls) -> str:
    # Each SDK class passes its type token to super().__init__ as a literal; read it from the source.
    import inspect
    import re
    return re.search(r"super\(\w+, __self__\)\.__init__\(\s*'([^']+)'", inspect.getsource(cls._internal_init))[1]


def _snake(value):
    import re
    if isinstance(value, dict):
        return {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower(): _snake(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snake(v) for v in value]
    return value


def floor(types_file: str) -> dict:
    """The bare SDK for the same resources: each declared with its SDK class and its input values as
    plain data, with the same dependencies, and no logic: no settings, components or Outputs between them."""
    sys.path.insert(0, str(REPO))
    import pulumi
    from tests.conftest import use_mocks

    registrations = [r for r in json.loads(Path(types_file).read_text()) if r[1]]  # components are program logic
    classes = _sdk_classes()
    monitor = use_mocks(_config(0), stack="bench")

    @pulumi.runtime.test
    def program():
        made: list[pulumi.Resource] = []
        for i, (typ, _, inputs, deps) in enumerate(registrations):
            opts = pulumi.ResourceOptions(depends_on=[made[d] for d in deps if d < len(made)])
            if typ == "command:remote:CopyToRemote":
                inputs = {**inputs, "source": pulumi.FileArchive(inputs["source"]["path"])}
            made.append(classes[typ](f"r{i}", opts=opts, **_snake(inputs)))
        return pulumi.Output.all(*[r.urn for r in made])

    start = time.perf_counter()
    program()
    seconds = time.perf_counter() - start
    return {"resources": len(monitor.requests), "seconds": seconds,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child(*args: str) -> dict:
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--runs", type=int, default=3, help="runs of each, program and floor in turn; medians")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--types-out", help=argparse.SUPPRESS)
    parser.add_argument("--floor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        print(json.dumps(floor(args.floor)))
        return
    if args.child is not None:
        print(json.dumps(measure(args.child, args.trace, args.types_out)))
        return

    import os
    import platform
    import statistics
    import tempfile
    print(f"machine: {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}; "
          f"median of {args.runs} runs, program and floor alternating")
    rows = []
    for size in args.sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as types:
            program_s, floor_s = [], []
            for _ in range(args.runs):  # tracemalloc slows Python down: time without it
                timed = child("--child", str(size), "--types-out", types.name)
                program_s.append(timed["seconds"])
                floor_s.append(child("--floor", types.name)["seconds"])
        traced = child("--child", str(size), "--trace")
        rows.append((size, timed, statistics.median(program_s), statistics.median(floor_s), traced))

    print("| GPU nodes (+3 managers) | resources | program s | SDK floor s | program / floor | maxrss MiB "
          "| traced peak MiB | ms per added node |")
    print("|---|---|---|---|---|---|---|---|")
    base_size, _, base_s, _, _ = rows[0]
    for size, timed, program, floor_time, traced in rows:
        added = size - base_size
        per_ms = f"{(program - base_s) * 1000 / added:.1f}" if added else "-"
        print(f"| {size} | {timed['resources']} | {program:.2f} | {floor_time:.2f} | {program / floor_time:.2f} "
              f"| {timed['maxrss_mib']:.0f} | {traced['traced_peak_mib']:.1f} | {per_ms} |")
    print(f"(per added node: the growth over the {base_size}-node run, which holds the fixed cost)")

if __name__ == "__main__":
    main()
