"""bench/gpu_session.sh, the one real-GPU session: its program runner, time budgets and the
at most 8 files it leaves in $OUT, run for real without a GPU, a kit or an engine."""
from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SESSION = REPO / "bench" / "gpu_session.sh"


def session(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SESSION), "--prefix", str(tmp_path / "root"), "--out", str(tmp_path / "out"),
                           "--no-gpu", *args], capture_output=True, text=True, timeout=timeout)


def programs(tmp_path: Path) -> dict[str, str]:
    """Small programs that behave as bench programs may: pass, write a file, fail, outlive their budget."""
    bin_ = tmp_path / "programs"
    bin_.mkdir()
    texts = {
        "ok.py": "import sys; from pathlib import Path\nout = Path(sys.argv[sys.argv.index('--out') + 1])\n"
                 "(out / 'deep').mkdir(parents=True); (out / 'deep' / 'r.json').write_text('{}')\nprint('ok ran')\n",
        "file.sh": 'out=${*: -1}; echo "a result" >"$out"; echo "wrote $out"\n',
        "fail.py": "import sys; print('failing on purpose'); sys.exit(3)\n",
        "slow.sh": "echo slow started; sleep 60\n",
    }
    for name, text in texts.items():
        (bin_ / name).write_text(text)
    return {name: str(bin_ / name) for name in texts}


@pytest.mark.parametrize("spec, says", [
    ("no-equals-sign", "expected NAME[:SECONDS]=PROGRAM"),
    ("bad name=bench/x.py", "expected NAME[:SECONDS]=PROGRAM"),
    ("a:ten=bench/x.py", "expected NAME[:SECONDS]=PROGRAM"),
    ("summary=bench/x.py", "is taken"),
])
def test_a_bad_program_spec_is_refused_before_anything_runs(tmp_path, spec, says):
    done = session(tmp_path, spec)
    assert done.returncode == 2 and says in done.stderr
    assert not (tmp_path / "out").exists()


def test_two_programs_of_one_name_and_more_than_five_are_refused(tmp_path):
    done = session(tmp_path, "a=x.py", "a=y.py")
    assert done.returncode == 2 and "is taken" in done.stderr
    done = session(tmp_path, *[f"p{i}=x.py" for i in range(6)])
    assert done.returncode == 2 and "at most 5" in done.stderr and "8 files" in done.stderr


def test_without_its_kit_no_program_runs_and_every_one_is_recorded(tmp_path):
    done = session(tmp_path, "--kit", str(tmp_path / "no-kit"), "a:30=bench/gpu_e2e.py", "b=bench/gpu_e2e.py")
    assert done.returncode == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(s["step"], s["rc"] == 0) for s in summary["setup"]] == [("machine", True), ("kit", False)]
    assert [p["status"] for p in summary["programs"]] == ["not run: set-up failed at 'kit'"] * 2
    assert "run bash bench/build_gpu_kit.sh" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "a.tar.gz", "b.tar.gz", "session.log", "session.tar.gz", "summary.json"]


def test_programs_run_in_their_budgets_and_come_back_in_at_most_eight_files(tmp_path):
    p = programs(tmp_path)
    done = session(tmp_path, "--no-setup", "--deadline", "120", f"ok:20={p['ok.py']}", f"file:20={p['file.sh']}",
                   f"slow:2={p['slow.sh']} --an-arg", f"fail:20={p['fail.py']}", "gone=bench/not_there.py")
    assert done.returncode == 1, done.stdout[-3000:]
    out = tmp_path / "out"
    files = sorted(f.name for f in out.iterdir())
    assert files == ["fail.tar.gz", "file.tar.gz", "gone.tar.gz", "ok.tar.gz", "session.log", "session.tar.gz",
                     "slow.tar.gz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    status = {p["name"]: (p["rc"], p["status"]) for p in summary["programs"]}
    assert status["ok"] == (0, "passed") and status["file"] == (0, "passed")
    assert status["slow"] == (124, "timed out after 2 s")
    assert status["fail"] == (3, "failed (exit 3)")
    assert status["gone"][0] == -1 and "does not exist" in status["gone"][1]
    assert summary["ok"] is False and summary["setup"] == [{"step": "machine", "rc": 0, "seconds": summary["setup"][0]
                                                            ["seconds"]}]
    members = {name: tarfile.open(out / f"{name}.tar.gz").getnames() for name in status}
    assert sorted(members["ok"]) == ["ok/console.log", "ok/deep/r.json"]
    assert sorted(members["file"]) == ["file/console.log", "file/out"]  # a program that wrote a file
    slow = tarfile.open(out / "slow.tar.gz").extractfile("slow/console.log").read().decode()
    assert slow == "slow started\n"
    log = (out / "session.log").read_text()
    assert "ok ran" in log and "failing on purpose" in log and "result: SOMETHING FAILED" in log
    # committed as it is: $OUT is <out> there, at a word's end ("files in <out>:") as inside a path
    assert str(out) not in log and "files in <out>:" in log and "--out <out>/ok" in log
    console = tarfile.open(out / "file.tar.gz").extractfile("file/console.log").read().decode()
    assert console == "wrote <out>/file\n"


def test_a_program_the_deadline_leaves_too_little_time_is_not_started(tmp_path):
    p = programs(tmp_path)
    # 50 s: 15 kept for packing and 30 for a program to stop leave 5 s, enough for a 3 s
    # program but not for one that asked for 100.
    done = session(tmp_path, "--no-setup", "--deadline", "50", f"short:3={p['ok.py']}", f"long:100={p['ok.py']}")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    status = {p["name"]: p["status"] for p in summary["programs"]}
    assert status["short"] == "passed", done.stdout[-2000:]
    assert status["long"].startswith("not run:") and "of the session's 50 s" in status["long"]
