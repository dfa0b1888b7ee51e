#!/usr/bin/env python3
"""How long the preview spends on a Compose file: validate_stack_file over the compose corpus.

    .venv/bin/python bench/compose_preview.py [--runs 20] [--smoke]

Each case of tests/data/compose-corpus/cases.yaml runs through validate_stack_file as the
program runs it at `pulumi preview` (profiles, variables, secrets, `extends` read beside the
file), --runs times; the table gives the median per file. A refused file is timed until its
StackFileError, which is what the preview spends on it too. --smoke: one run over 3 cases.
Any other exception is a bug of the translator: its row says so, and the bench exits 1.
Prints a Markdown table: case | file | outcome | services | preview ms (wall) | CPU ms, and the
machine with its load average (other work on a shared machine stretches the wall time).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from swarm.labels import pool_labels  # noqa: E402
from swarm.stack_files import StackFileError, validate_stack_file  # noqa: E402

CORPUS = REPO / "tests" / "data" / "compose-corpus"


def preview(case: dict, cluster: dict, text: str):
    """The preview's result for one case on its cluster (the corpus's, as the case changes it): its
    StackInfo, or its StackFileError."""
    cluster = {**cluster, **case.get("cluster", {})}
    pools = {name: pool_labels(SimpleNamespace(name=name, instance_type="g6e.48xlarge", gpu_model="L40S",
                                               gpus_per_node=size, spot=False, slots_per_gpu=0))
             for name, size in cluster["pool_sizes"].items()}
    try:
        return validate_stack_file(
            text, kind=cluster["kind"], max_gpus_per_node=cluster["max_gpus_per_node"],
            pool_sizes=cluster["pool_sizes"], source=f"corpus/{case['file']}",
            profiles=tuple(case.get("profiles", ())), variables=dict(case.get("variables", {})),
            secrets=dict(case.get("secrets", {})), base_dir=CORPUS, pools=pools, pool_nodes=cluster["pool_nodes"])
    except StackFileError as err:
        return err
    except Exception as exc:  # a translator bug: the table says so, and the bench exits 1
        return exc


def time_case(case: dict, cluster: dict, runs: int) -> tuple[str, str, float, float]:
    """(outcome, services, median wall ms, median CPU ms): the file is read once, as settings read it.

    The CPU time (this process's) is the steadier figure on a shared machine: other work there
    stretches the wall time, not the CPU time."""
    text = (CORPUS / case["file"]).read_text(encoding="utf-8")
    samples, cpu = [], []
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = preview(case, cluster, text)
        samples.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    if isinstance(result, StackFileError):
        n = len(result.problems)
        return f"refused ({n} problem{'s' if n > 1 else ''})", "", statistics.median(samples), statistics.median(cpu)
    if isinstance(result, Exception):
        said = str(result)[:80].replace("|", "\\|").replace("\n", " ")
        return f"error: {type(result).__name__}: {said}", "", statistics.median(samples), statistics.median(cpu)
    services = ", ".join(f"{s.name}" + (f" ({s.gpus} GPU{'s' if s.gpus > 1 else ''})" if s.gpus else "")
                         for s in result.services)
    return "accepted", services, statistics.median(samples), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per case; the table gives the median")
    parser.add_argument("--smoke", action="store_true", help="one run over 3 cases (a quick check that it runs)")
    args = parser.parse_args(argv)
    spec = yaml.safe_load((CORPUS / "cases.yaml").read_text(encoding="utf-8"))
    cases, runs = (spec["cases"][:3], 1) if args.smoke else (spec["cases"], args.runs)

    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores (nproc), "
          f"Python {platform.python_version()} ({platform.python_implementation()}), "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"Median of {runs} run{'s' if runs > 1 else ''} of validate_stack_file per case "
          f"(cluster: {spec['cluster']['kind']}, pool_sizes {spec['cluster']['pool_sizes']})\n")
    print("| case | file | outcome | services | preview ms | CPU ms |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    total, total_cpu, errors = [], [], 0
    for case in cases:
        outcome, services, ms, cpu_ms = time_case(case, spec["cluster"], runs)
        total.append(ms)
        total_cpu.append(cpu_ms)
        errors += outcome.startswith("error")
        print(f"| {case['id']} | {case['file']} | {outcome} | {services} | {ms:.2f} | {cpu_ms:.2f} |")
    print(f"\n{len(cases)} cases; wall: median {statistics.median(total):.2f} ms, max {max(total):.2f} ms, "
          f"sum {sum(total):.1f} ms; CPU: median {statistics.median(total_cpu):.2f} ms, max {max(total_cpu):.2f} ms; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    if errors:
        print(f"{errors} cases ended in an error other than StackFileError: a bug of the translator")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
