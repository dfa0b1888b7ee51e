"""What the GPU benches share (gpu_e2e.py, gpu_mps.py, gpu_metrics.py): one table of checks, a dockerd of
the bench's own as a node runs it, one-shot jobs on its one-node swarm, the agent and the guard's server as
a node starts them, the stand-in CUDA image, and interleaved start timings. Not a bench: they import it.

Each bench has an Engine of its own (its data under /var/lib/<name>, its socket under /run/<name>), so
that two benches never share an engine or a swarm, and a bench stopped mid-way is cleared by its next run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIND, SHARED_KIND = "NVIDIA-GPU", "NVIDIA-GPU-SHARED"
CUDA_IMAGE = "nvidia/cuda:12.6.3-base-ubuntu24.04"  # what the stacks name: the stand-in, built here, offline
PROBE_IMAGE = "gpu-swarm.invalid/cuda-probe:1"  # the same image under a name no stack uses
UUID = re.compile(r"UUID: (GPU-[0-9a-f-]{36})")
results: list[tuple[str, bool, str]] = []  # one table of checks for the whole run


def check(name: str, ok: bool, detail: str = "") -> bool:
    results.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    return bool(ok)


def print_results(out: Path) -> int:
    """The table of every check, results.json beside it; the exit status: 1 when one failed."""
    print("\n| check | result | detail |\n|---|---|---|")
    for name, ok, detail in results:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail.replace('|', '/')} |")
    (out / "results.json").write_text(json.dumps([{"check": n, "ok": ok, "detail": d} for n, ok, d in results],
                                                 indent=2))
    failed = [n for n, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


def run(cmd: list[str], *, input: str | None = None, check_rc: bool = True, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=env, timeout=timeout)
    if check_rc and proc.returncode:
        shown = "a swarm/ script" if cmd[:2] == ["bash", "-c"] else " ".join(cmd)[:200]
        raise RuntimeError(f"{shown} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-600:]}")
    return proc


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def samples(text: str) -> list[tuple[str, dict, float]]:
    """A Prometheus text page as (metric, labels, value) rows."""
    rows = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[2] or ""))
            rows.append((match[1], labels, float(match[3])))
    return rows


def gpus_of_host() -> list[str]:
    if not shutil.which("nvidia-smi"):
        sys.exit("nvidia-smi is not on PATH: this needs a machine with NVIDIA GPUs and their driver")
    return UUID.findall(run(["nvidia-smi", "-L"]).stdout)


class Engine:
    """A bench's own dockerd (and the containerd it starts), on the daemon.json the agent wrote."""

    def __init__(self, name: str, run: str | None = None):
        self.root, self.run_dir = Path("/var/lib") / name, Path("/run") / (run or name)
        self.sock = f"unix://{self.run_dir}/docker.sock"
        self.proc: subprocess.Popen | None = None
        self.out: Path | None = None

    def env(self) -> dict:
        # GPU_SWARM_SOFTWARE: the node software the swarm/ scripts run (the stack deploy's waiter) is
        # this checkout's node/, as in the rehearsal, not a node's installed copy.
        return {**os.environ, "DOCKER_HOST": self.sock, "GPU_SWARM_SOFTWARE": str(REPO / "node"),
                "PATH": f"/usr/local/bin:{os.environ.get('PATH', '/usr/bin:/bin')}"}

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run(["docker", *args], env=self.env(), **kw)

    def script(self, text: str, stdin: str = "") -> str:
        """Run one of swarm/'s scripts on this node, as the program does over SSH."""
        return run(["bash", "-c", text], input=stdin, env=self.env(), timeout=600).stdout

    def clear(self) -> None:
        """What an earlier run left (on a machine kept warm between runs): its engine, its mounts, then
        its files. Every run starts from a bare engine: no image or swarm left over."""
        try:
            stale = int((self.run_dir / "dockerd.pid").read_text())
            if str(self.root) in Path(f"/proc/{stale}/cmdline").read_text():
                os.kill(stale, signal.SIGTERM)
                wait(lambda: not Path(f"/proc/{stale}").exists(), 30, f"the engine an earlier run left (pid {stale})")
        except (OSError, ValueError):
            pass  # none left
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if line.split()[4].startswith(f"{self.root}/")]
        for point in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():
            sys.exit(f"{self.root} is left from an earlier run and cannot be removed; remove it and run again")
        self.root.mkdir(parents=True)

    def start(self, out: Path) -> None:
        self.out = out
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = ["dockerd", "--config-file", str(self.root / "daemon.json"), "--data-root", str(self.root / "docker"),
               "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.run_dir / "dockerd.pid"),
               "-H", self.sock,
               # No iptables on the test machine; these must not be in daemon.json as well.
               "--iptables=false", "--ip6tables=false"]
        env = {**self.env(), "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE": "1"}  # no registry here: use local images
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(out / "dockerd.log", "ab"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait(lambda: self.proc.poll() is not None or self.docker(
                "version", "--format", "{{.Server.Version}}", check_rc=False).returncode == 0, 60, "dockerd")
        except RuntimeError:
            pass  # said below, with where its log is
        if self.proc.poll() is not None or self.docker("version", check_rc=False).returncode:
            raise RuntimeError(f"dockerd did not start; see {out / 'dockerd.log'}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def restart(self) -> None:
        """dockerd reads node-generic-resources only when it starts, as the agent's unit knows."""
        self.stop()
        self.start(self.out)

    def job(self, name: str, image: str, command: str, *extra: str, timeout: float = 120) -> str:
        """A one-shot job on this node; its final state line, then its log."""
        self.docker("service", "create", "--detach", "--mode", "replicated-job", "--restart-condition", "none",
                    "--name", name, *extra, image, "sh", "-c", command)
        try:
            state = wait(lambda: next((s for s in self.docker(
                "service", "ps", "--no-trunc", "--format", "{{.CurrentState}} {{.Error}}", name, check_rc=False)
                .stdout.splitlines() if s.startswith(("Complete", "Failed", "Rejected"))), None), timeout, name)
            logs = ""
            for _ in range(10):  # a task's last lines reach the service's log a moment after it ends
                done = self.docker("service", "logs", "--raw", name, check_rc=False)
                logs = done.stdout + done.stderr
                if logs.strip() or state.startswith("Rejected") or "starting container failed" in state:  # never ran
                    break
                time.sleep(0.5)
            return state + "\n" + logs
        finally:
            self.docker("service", "rm", name, check_rc=False)

    def build_images(self, out: Path, probe: str) -> None:
        """The post-join check's image, as a node builds it, and the stand-in for nvidia/cuda (its
        environment, and cuda-probe for real CUDA work) under CUDA_IMAGE and PROBE_IMAGE."""
        from swarm.gpu_check import CHECK_IMAGE
        env = {**self.env(), "GPU_SWARM_VERSIONS": str(REPO / "node" / "versions.env"),
               "GPU_SWARM_LOG": str(out / "build.log"), "GPU_SWARM_STATE": str(self.root / "state"),
               "GPU_SWARM_NODE_ENV": "/nonexistent"}
        run(["bash", str(REPO / "node" / "build-check-image.sh")], env={**env, "GPU_SWARM_CHECK_IMAGE": CHECK_IMAGE})
        run(["bash", str(REPO / "bench" / "cuda_standin.sh"), CUDA_IMAGE, probe], env=env)
        self.docker("tag", CUDA_IMAGE, PROBE_IMAGE)


def agent(engine: Engine, out: Path, slots: int = 0) -> dict:
    """The node's GPU agent, writing this engine's daemon.json and the guard's settings beside it, with
    the guard's server in the engine's run folder; slots > 0: that many slots per GPU."""
    cmd = [sys.executable, str(REPO / "node" / "gpu_agent.py"), "--json",
           "--daemon-json", str(engine.root / "daemon.json"), "--runtime-config", str(engine.root / "runtime.env"),
           "--guard", str(REPO / "node" / "gpu-swarm-runtime"), "--guard-server", str(engine.run_dir / "guard"),
           "--runtime-delegate", shutil.which("nvidia-container-runtime") or "/usr/bin/nvidia-container-runtime"]
    if slots:
        cmd += ["--slots-per-gpu", str(slots), "--shared-kind", SHARED_KIND]
    report = json.loads(run(cmd).stdout)
    (out / f"agent-report{'-shared' if slots else ''}.json").write_text(json.dumps(report, indent=2))
    return report


def start_guard_server(out: Path, runtime_env: Path) -> subprocess.Popen:
    """The guard's server, as gpu-swarm-guard.service runs it before docker on a node, where the
    agent's runtime.env points the runtime; so the containers here take a node's real path."""
    settings = dict(line.split("=", 1) for line in runtime_env.read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    directory = Path(settings["GUARD_SERVER"])
    (directory / "server.pid").unlink(missing_ok=True)
    proc = subprocess.Popen(["/usr/bin/python3", "-I", "-S", str(REPO / "node" / "guard_server.py"), str(directory)],
                            stdout=open(out / "guard-server.log", "ab"), stderr=subprocess.STDOUT)
    started = (directory / "server.pid").exists
    try:
        wait(lambda: started() or proc.poll() is not None, 10, "the guard's server")
    except RuntimeError:
        pass  # said below, with where its log is
    if proc.poll() is not None or not started():
        proc.kill()
        raise RuntimeError(f"the guard's server did not start in {directory}; see {out / 'guard-server.log'}")
    return proc


def sample_starts(engine: Engine, variants: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """Seconds of `docker run --rm` of CUDA_IMAGE per variant on the engine, interleaved so that drift
    hits each alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(runs + 1):
        for name, args in variants.items():
            t0 = time.perf_counter()
            engine.docker("run", "--rm", *args, CUDA_IMAGE, "true")
            if i:  # the first round warms caches
                samples[name].append(time.perf_counter() - t0)
    return samples
