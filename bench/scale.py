"""How the program's evaluation cost grows with the cluster: time and memory under Pulumi's mocks.

    .venv/bin/python bench/scale.py [--sizes 100 500 1000 2000] [--runs 3] [--profile]
    .venv/bin/python bench/scale.py --smoke          # tiny sizes, one run: that the bench still runs

Each size runs in a fresh interpreter, so peak memory of one size does not hide another's.
It measures the Python side only (settings, components, every registration answered by the
mocks); with the real engine, provider calls and SSH commands add to it.

Beside each size it times the SDK's floor: a program with no logic of its own that replays the
program's registrations (same types, same input values as plain data, same dependencies, each
declared the cheapest way the SDK has, components/chain.py's URN stand-in) through the same mocks. The ratio is what the program's own logic (settings, Output wiring,
rendering the scripts) costs on top of what Pulumi needs for those resources. The floor finds
each type's SDK class where the SDK itself does (the resource modules each provider package
registers), so a type the program starts to use needs nothing here.

Times are the process's CPU seconds (all its threads), so that the comparison holds on a machine
that other work shares; the program's wall seconds are beside them. Both run under the program's
garbage-collector setting (components/collector.py).

A size that crashes (the program or its floor) is a row with the error, and the exit status is 1.
--profile runs each size once more under cProfile, program and floor, and prints the top entries.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMOKE_SIZES = [1, 3]


POOL_MAX = 1000  # nodes in one pool (settings: gpuPools[].count); more go to further pools of that size


def _config(gpu_nodes: int) -> dict:
    from tests.conftest import stack_config
    counts = [min(POOL_MAX, gpu_nodes - start) for start in range(0, gpu_nodes, POOL_MAX)] or [0]
    return stack_config(
        "prod",
        managerCount="3",
        gpuPools=[{"name": "gpu" if i == 0 else f"gpu{i + 1}", "instanceType": "g6.xlarge", "count": count}
                  for i, count in enumerate(counts)],
        # prod's shared-GPU stack needs a sharing pool; one whole-GPU pool runs the smoke stack
        stacks=[{"name": "gpu-smoke", "file": "stacks/gpu-smoke.yml"}],
    )


def _profiled(call, profile_out: str | None):
    if not profile_out:
        return call()
    import cProfile
    profiler = cProfile.Profile()
    try:
        return profiler.runcall(call)
    finally:
        profiler.dump_stats(profile_out)


def measure(gpu_nodes: int, trace: bool, types_out: str | None = None, profile_out: str | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.conftest import run_program  # the test suite's mocks

    from components import collector
    collector.FREEZE = True  # one run in this process, as in `pulumi up` (the test suite turns it off)
    from localswarm import fake_aws
    # An account that runs thousands of GPU nodes has the EC2 vCPU quota for them (g6.xlarge: 4 vCPUs).
    fake_aws.DEFAULT_QUOTA = max(fake_aws.DEFAULT_QUOTA, 8.0 * gpu_nodes)
    config = _config(gpu_nodes)
    if trace:
        tracemalloc.start()
    start, cpu = time.perf_counter(), time.process_time()
    run = _profiled(lambda: run_program(config, stack="bench"), profile_out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    assert len(run.exports["inventory"]) == gpu_nodes + 3
    if types_out:
        Path(types_out).write_text(json.dumps(registrations(run.monitor)))
    return {
        "gpu_nodes": gpu_nodes,
        "resources": len(run.monitor.requests),
        "seconds": seconds,
        "cpu_s": cpu,
        "traced_peak_mib": peak / 2**20,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def registrations(monitor) -> list:
    """(type, custom, inputs as plain data, indexes of the custom resources it depends on, name), in
    registration order. Names are the program's: the fake AWS derives ids and addresses from them."""
    from tests.conftest import request_inputs, unwrap
    if monitor.duplicate_names:
        raise SystemExit(f"bench/scale.py: names registered twice ({monitor.duplicate_names[:3]}): the floor "
                         f"replays by name")
    requests = [r for r in monitor.requests.values() if r.type != "pulumi:pulumi:Stack"]
    index = {r.name: i for i, r in enumerate(r for r in requests if r.custom)}
    return [(r.type, r.custom, unwrap(request_inputs(r)) if r.custom else {},
             sorted({index[d.split("::")[-1]] for d in r.dependencies if d.split("::")[-1] in index}), r.name)
            for r in requests]


def sdk_class(typ: str):
    """The SDK class of a type token, found as the SDK finds it when it reads a resource back:
    the package `pulumi_<pkg>` registers a resource module per `<pkg>:<module>`, which names the class."""
    from pulumi.runtime import rpc
    try:
        pkg, mod, _ = typ.split(":")
    except ValueError:
        raise SystemExit(f"bench/scale.py: '{typ}' is not a Pulumi type token (pkg:module:Type)") from None
    try:
        importlib.import_module(f"pulumi_{pkg}")
    except ImportError:
        raise SystemExit(f"bench/scale.py: the SDK floor cannot replay '{typ}': no Python package pulumi_{pkg} "
                         f"is installed; add it to requirements.txt as the program's other providers are") from None
    module = rpc.get_resource_module(pkg, mod, "")
    classes = getattr(module, "mod_info", {}).get("classes", {})
    if typ not in classes:
        raise SystemExit(f"bench/scale.py: the SDK floor cannot replay '{typ}': pulumi_{pkg} registers no class for "
                         f"it (its resource module '{pkg}:{mod}' has {sorted(classes) or 'none'}); a component "
                         f"the program defines is not replayed, so is this type registered as custom?")
    return getattr(importlib.import_module(module.mod_info["fqn"]), classes[typ])


def _as_sdk_value(value):
    """Plain data back into what the SDK serializes to it: assets and archives are objects, not dicts."""
    import pulumi
    from pulumi.runtime import rpc
    if isinstance(value, list):
        return [_as_sdk_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    sig = value.get(rpc._special_sig_key)
    if sig is None:
        return {k: _as_sdk_value(v) for k, v in value.items()}
    if sig == rpc._special_archive_sig:
        if "assets" in value:
            return pulumi.AssetArchive({k: _as_sdk_value(v) for k, v in value["assets"].items()})
        return pulumi.FileArchive(value["path"]) if "path" in value else pulumi.RemoteArchive(value["uri"])
    if sig == rpc._special_asset_sig:
        if "text" in value:
            return pulumi.StringAsset(value["text"])
        return pulumi.FileAsset(value["path"]) if "path" in value else pulumi.RemoteAsset(value["uri"])
    raise SystemExit(f"bench/scale.py: the SDK floor cannot replay an input of kind {sig} (a resource reference "
                     f"or an output value); teach _as_sdk_value to make it")


def _kwarg(name: str) -> str:
    # Only the top-level names are Python's: the SDK maps a nested dict's camelCase keys as they are,
    # and tags or environment names must not change.
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def floor(types_file: str, profile_out: str | None = None) -> dict:
    """The bare SDK for the same resources: each declared with its SDK class and its input values as
    plain data, with the same dependencies, and no logic: no settings, components or Outputs between them."""
    sys.path.insert(0, str(REPO))
    import pulumi
    from tests.conftest import use_mocks

    from components import collector
    replayed = [r for r in json.loads(Path(types_file).read_text()) if r[1]]  # components are program logic
    monitor = use_mocks(_config(0), stack="bench")
    collector.FREEZE = True  # as in measure()
    collector.for_a_large_graph()  # as __main__.py does: the ratio is the program's logic, not the collector's

    from components.chain import after

    @pulumi.runtime.test
    def program():
        # On the clock, as in the program: a program that declares these types imports their provider
        # modules (pulumi_aws.ec2 alone takes about 0.2 s), and the program pays that inside its run.
        classes = {typ: sdk_class(typ) for typ in sorted({r[0] for r in replayed})}
        made: list[pulumi.Resource] = []
        for typ, _, inputs, deps, name in replayed:
            # Every dependency as the SDK's URN stand-in, as the program declares its roll's chain: the
            # least the SDK needs for the same dependencies (a plain one is walked by its cycle check).
            opts = pulumi.ResourceOptions(depends_on=[after(made[d]) for d in deps if d < len(made)])
            made.append(classes[typ](name, opts=opts, **{_kwarg(k): _as_sdk_value(v) for k, v in inputs.items()}))
        return pulumi.Output.all(*[r.urn for r in made])

    start, cpu = time.perf_counter(), time.process_time()
    _profiled(program, profile_out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    _check_replay(monitor, replayed)
    return {"resources": len(monitor.requests), "seconds": seconds, "cpu_s": cpu,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _check_replay(monitor, replayed: list) -> None:
    """The floor is only a floor if it registered what the program did: same types, inputs and dependencies."""
    from tests.conftest import request_inputs, unwrap
    index = {r[4]: i for i, r in enumerate(replayed)}
    wrong = []
    for typ, _, inputs, deps, name in replayed:
        request = monitor.requests.get(name)
        got_deps = sorted(index[d.split("::")[-1]] for d in request.dependencies) if request else None
        if request is None or request.type != typ or unwrap(request_inputs(request)) != inputs or got_deps != deps:
            wrong.append(f"{name} ({typ})")
    if wrong:
        raise SystemExit(f"bench/scale.py: the SDK floor did not replay {len(wrong)} of the program's "
                         f"{len(replayed)} resources as registered: {', '.join(wrong[:3])}")


def child(*args: str) -> dict:
    """One measurement in a fresh interpreter; a crash comes back as {"error": its last line}."""
    done = subprocess.run([sys.executable, __file__, *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def top_entries(profile_file: str, limit: int) -> str:
    """The functions with the most time of their own, and with the most time under them."""
    import io
    import pstats
    text = io.StringIO()
    stats = pstats.Stats(profile_file, stream=text)
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)
    # the header repeats the file name, and each table's preamble the totals: keep the tables
    return "\n".join(line.replace(str(Path(sys.prefix)), "$VENV") for line in text.getvalue().splitlines()
                     if line.strip() and not line.startswith(profile_file))


def run_sizes(sizes: list[int], runs: int) -> list[dict]:
    import statistics
    import tempfile
    rows = []
    for size in sizes:
        row: dict = {"gpu_nodes": size}
        with tempfile.NamedTemporaryFile(suffix=".json") as types:
            program_s, floor_s, wall_s = [], [], []
            for _ in range(runs):  # tracemalloc slows Python down: time without it
                timed = child("--child", str(size), "--types-out", types.name)
                if "error" in timed:
                    row["error"] = f"program: {timed['error']}"
                    break
                program_s.append(timed["cpu_s"])
                wall_s.append(timed["seconds"])
                floored = child("--floor", types.name)
                if "error" in floored:
                    row["error"] = f"SDK floor: {floored['error']}"
                    break
                floor_s.append(floored["cpu_s"])
        if "error" not in row:
            traced = child("--child", str(size), "--trace")
            row.update(resources=timed["resources"], program_s=statistics.median(program_s),
                       floor_s=statistics.median(floor_s), wall_s=statistics.median(wall_s), maxrss_mib=timed["maxrss_mib"],
                       floor_maxrss_mib=floored["maxrss_mib"],
                       traced_peak_mib=traced.get("traced_peak_mib", float("nan")))
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| GPU nodes (+3 managers; pools of at most 1000) | resources | program CPU s | SDK floor CPU s "
          "| program / floor | program wall s | maxrss MiB | floor maxrss MiB | traced peak MiB | ms per added node "
          "| t / t(first) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = next((r for r in rows if "error" not in r), None)
    for row in rows:
        if "error" in row:
            print(f"| {row['gpu_nodes']} | crash: {row['error']} | | | | | | | | | |")
            continue
        added = row["gpu_nodes"] - base["gpu_nodes"]
        per_ms = f"{(row['program_s'] - base['program_s']) * 1000 / added:.1f}" if added else "-"
        print(f"| {row['gpu_nodes']} | {row['resources']} | {row['program_s']:.2f} | {row['floor_s']:.2f} "
              f"| {row['program_s'] / row['floor_s']:.2f} | {row['wall_s']:.2f} | {row['maxrss_mib']:.0f} "
              f"| {row['floor_maxrss_mib']:.0f} "
              f"| {row['traced_peak_mib']:.1f} | {per_ms} | {row['program_s'] / base['program_s']:.2f} "
              f"(nodes {row['gpu_nodes'] / base['gpu_nodes']:.0f}x) |")
    if base:
        print(f"(per added node: the growth over the {base['gpu_nodes']}-node run, which holds the fixed cost)")


def print_profiles(sizes: list[int], limit: int) -> None:
    import tempfile
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            types, prog, flo = f"{tmp}/types.json", f"{tmp}/program.prof", f"{tmp}/floor.prof"
            for what, args, prof in (("program", ("--child", str(size), "--types-out", types), prog),
                                     ("SDK floor", ("--floor", types), flo)):
                result = child(*args, "--profile-out", prof)
                print(f"\n## {size} GPU nodes, {what}: "
                      + (f"crash: {result['error']}" if "error" in result else f"{result['seconds']:.2f} s under cProfile"))
                if Path(prof).exists():
                    print(top_entries(prof, limit))
                if "error" in result:
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 1000, 2000])
    parser.add_argument("--runs", type=int, default=3, help="runs of each, program and floor in turn; medians")
    parser.add_argument("--smoke", action="store_true", help=f"sizes {SMOKE_SIZES}, one run: that the bench runs")
    parser.add_argument("--profile", action="store_true", help="then profile each size once (cProfile) and print "
                        "the top entries, program and floor")
    parser.add_argument("--top", type=int, default=25, help="entries per profile table (default %(default)s)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--types-out", help=argparse.SUPPRESS)
    parser.add_argument("--floor", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        print(json.dumps(floor(args.floor, args.profile_out)))
        return
    if args.child is not None:
        print(json.dumps(measure(args.child, args.trace, args.types_out, args.profile_out)))
        return
    if args.smoke:
        args.sizes, args.runs = SMOKE_SIZES, 1

    import os
    import platform
    print(f"machine: {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}; "
          f"median of {args.runs} runs, program and floor alternating")
    rows = run_sizes(args.sizes, args.runs)
    print_table(rows)
    if args.profile:
        print_profiles(args.sizes, args.top)
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
