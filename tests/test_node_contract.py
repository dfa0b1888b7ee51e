"""node/contract.py: one definition of every label, environment key and node path, used everywhere.

The node programs import it as a sibling, the program through swarm/node_contract.py; the
shell and the units cannot import it, so their spellings are compared with it here; and no
other Python file may spell one of its labels or gpu-swarm's node paths itself.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import labels, node_contract
from tests.tools import files_git_lists

REPO = Path(__file__).resolve().parent.parent
NODE = REPO / "node"
CONTRACT = NODE / "contract.py"


def public(module) -> dict:
    return {name: value for name, value in vars(module).items() if name.isupper()}


def test_the_program_sees_what_the_nodes_import():
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import contract; "
            "print(json.dumps({k: v for k, v in vars(contract).items() if k.isupper()}))")
    done = subprocess.run([sys.executable, "-I", "-c", code, str(NODE)], capture_output=True, text=True, check=True)
    on_node = json.loads(done.stdout)
    assert on_node and set(node_contract.__all__) == set(on_node)
    # Through JSON on both sides: a tuple there is the same value as the list it prints.
    assert json.loads(json.dumps({name: getattr(node_contract, name) for name in node_contract.__all__})) == on_node


def test_swarm_labels_re_exports_every_label_of_the_contract():
    names = {n for n in vars(labels) if n.isupper()}
    assert {n for n in node_contract.__all__ if n.endswith("_LABEL") or n.startswith("DRAINED_BY_")} <= names
    for name in names:
        assert getattr(labels, name) == getattr(node_contract, name), name
    assert "node_label()" in labels.node_label_function()


def test_the_contract_imports_nothing_and_every_name_says_who_writes_and_reads_it():
    source = CONTRACT.read_text()
    tree = ast.parse(source)
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id.isupper():
            line, before = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            assert "#" in line or before.startswith("#"), f"{node.targets[0].id} has no comment"


def test_values_are_unique():
    values = [v for v in public(node_contract).values() if isinstance(v, str)]
    assert not {v for v in values if values.count(v) > 1}


def test_node_paths_live_under_the_folders_they_name():
    c = node_contract
    assert all(p.startswith(c.SOFTWARE_DIR + "/") for p in (c.AGENT_PATH, c.WATCHER_PATH, c.RECONCILER_PATH,
                                                              c.GUARD_PATH, c.NODE_VERSIONS_ENV))
    assert all(p.startswith(c.CONFIG_DIR + "/") for p in (c.NODE_ENV_PATH, c.HEALTH_ENV_PATH, c.RELEASE_ENV_PATH,
                                                            c.RUNTIME_ENV_PATH))
    assert all(Path(p).parent == Path(c.STATE_DIR) for p in (c.BOOTSTRAP_TIMINGS, c.INSTALL_TIMINGS, c.BOOTSTRAP_DONE,
                                                             c.BOOTSTRAP_FAILED, c.APPLIED, c.HEALTH_STATE_PATH))
    for name, value in public(c).items():
        if name.endswith("_LABEL"):
            # Docker's own labels, which the program only reads, are the one exception.
            assert value.startswith((c.LABEL_PREFIX, c.GPU_LABEL_PREFIX, c.EFA_LABEL_PREFIX, "com.docker.")), name


# ---------------------------------------------------------------- what the shell and the units spell


def shell_defaults(path: Path) -> dict[str, str]:
    """`: "${NAME:=default}"` and `NAME=${OTHER:-default}` defaults of a script."""
    text = path.read_text()
    return {**dict(re.findall(r'"\$\{(\w+):=([^}]*)\}"', text)), **dict(re.findall(r"(\w+)=\$\{\w+:-([^}]*)\}", text))}


def unit(name: str) -> str:
    return (NODE / name).read_text()


def test_common_sh_defaults_are_the_contract_paths():
    defaults = shell_defaults(NODE / "common.sh")
    for var, path in node_contract.SCRIPT_PATH_VARS.items():
        assert defaults[var] == path, var


def test_the_check_image_and_the_runtime_settings_are_the_contracts():
    c = node_contract
    assert shell_defaults(NODE / "build-check-image.sh")["image"] == c.CHECK_IMAGE
    assert f"${{{c.CHECK_IMAGE_VAR}:-" in (NODE / "build-check-image.sh").read_text()
    assert f"config={c.RUNTIME_ENV_PATH}\n" in (NODE / "gpu-swarm-runtime").read_text()


def test_the_units_run_and_read_the_contracts_paths():
    c = node_contract
    agent = unit(c.AGENT_UNIT)
    assert f"{c.AGENT_VENV}/bin/python {c.AGENT_PATH} " in agent
    assert f"EnvironmentFile=-{c.NODE_ENV_PATH}\n" in agent
    assert f"Environment={c.KIND_ENV}=" in agent and f"$${{{c.KIND_ENV}}}" in agent
    assert f"$${{{c.AGENT_ARGS_ENV}}}" in agent
    report = Path(c.AGENT_REPORT_PATH)
    assert f"RuntimeDirectory={report.parent.name}\n" in agent and agent.count(str(report)) >= 2  # written, read
    health = unit(c.HEALTH_UNIT)
    assert f"ExecStart={c.AGENT_VENV}/bin/python {c.WATCHER_PATH}\n" in health
    assert f"EnvironmentFile=-{c.NODE_ENV_PATH}\n" in health and f"EnvironmentFile=-{c.HEALTH_ENV_PATH}\n" in health
    reconciler = unit(c.RECONCILER_UNIT)
    assert f"ExecStart=/usr/bin/python3 {c.RECONCILER_PATH}\n" in reconciler
    assert f"EnvironmentFile=-{c.HEALTH_ENV_PATH}\n" in reconciler
    assert f"ExecStart=/usr/bin/python3 {c.SCALER_PATH}\n" in unit(c.SCALER_UNIT)
    for name, program in ((c.AGENT_UNIT, c.AGENT_PATH), (c.HEALTH_UNIT, c.WATCHER_PATH),
                          (c.RECONCILER_UNIT, c.RECONCILER_PATH), (c.SCALER_UNIT, c.SCALER_PATH)):
        assert f"Documentation=file://{program}\n" in unit(name)


def test_every_gpu_swarm_path_the_shell_and_the_units_spell_is_in_the_contract():
    c = node_contract
    paths = {v for v in public(c).values() if isinstance(v, str) and v.startswith("/")}
    seen = 0
    for path in sorted(NODE.iterdir()):
        if path.suffix == ".py" or not path.is_file():
            continue
        # Absolute paths only ($here/x.service is not one); file:///opt/... is /opt/...
        for word in re.findall(r"(?<![\w}/])/+([\w./-]*gpu-swarm[\w./-]*)", path.read_text()):
            word = "/" + word.rstrip(".")
            assert word in paths or word.startswith(c.AGENT_VENV + "/bin/"), f"{path.name}: {word}"
            seen += 1
    assert seen >= 10  # common.sh, the units, gpu-swarm-runtime


def test_the_steps_install_the_contracts_units_and_read_its_keys():
    c = node_contract
    assert c.AGENT_UNIT in (NODE / "install-gpu-agent.sh").read_text()
    assert f"install_service {c.HEALTH_UNIT}" in (NODE / "install-health-watcher.sh").read_text()
    assert f"install_service {c.RECONCILER_UNIT}" in (NODE / "install-reconciler.sh").read_text()
    assert f"install_service {c.SCALER_UNIT}" in (NODE / "install-reconciler.sh").read_text()
    driver = (NODE / "install-nvidia-driver.sh").read_text()
    assert f"${{{c.IMAGE_ENV}:-}}" in driver and f"${{{c.KERNEL_MODULES_ENV}:-" in driver


# ---------------------------------------------------------------- the node programs read the contract's keys


def load_node_program(name: str):
    spec = importlib.util.spec_from_file_location(f"contract_test_{name}", NODE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(NODE))  # as on a node: its siblings beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(NODE))
    return module


def test_the_watcher_and_the_reconciler_take_their_defaults_from_the_contracts_keys():
    c = node_contract
    watcher = load_node_program("gpu_health")
    args = watcher.parse_args([], env={c.KIND_ENV: "A100", c.SHARED_KIND_ENV: "A100-SLOT", c.SPOT_ENV: "true",
                                       c.HEALTH_INTERVAL_ENV: "7", c.HEALTH_RECOVERY_ENV: "70",
                                       c.HEALTH_IGNORE_XIDS_ENV: "48", c.HEALTH_CRITICAL_XIDS_ENV: "13"})
    assert (args.kind, args.shared_kind, args.spot, args.interval, args.recovery_seconds) == \
        ("A100", "A100-SLOT", True, 7.0, 70.0)
    assert (args.ignore_xids, args.critical_xids) == (frozenset({48}), frozenset({13}))
    assert (args.daemon_json, args.state_file, args.dockerd_pidfile) == \
        (c.DOCKER_DAEMON_JSON, c.HEALTH_STATE_PATH, c.DOCKERD_PIDFILE)
    reconciler = load_node_program("swarm_reconciler")
    assert reconciler.parse_args([], env={c.HEALTH_MAX_DRAINED_PERCENT_ENV: "25"}).max_drained_percent == 25


def test_the_agent_takes_its_defaults_from_the_contract(monkeypatch):
    c = node_contract
    agent = load_node_program("gpu_agent")
    for key, value in {c.KIND_ENV: "A100", c.SLOTS_PER_GPU_ENV: "4", c.SHARED_KIND_ENV: "A100-SLOT"}.items():
        monkeypatch.setenv(key, value)
    args = agent.parse_args([])
    assert (args.kind, args.slots_per_gpu, args.shared_kind) == ("A100", 4, "A100-SLOT")
    assert (args.daemon_json, args.toolkit_config, args.guard, args.runtime_config) == \
        (c.DOCKER_DAEMON_JSON, c.TOOLKIT_CONFIG, c.GUARD_PATH, c.RUNTIME_ENV_PATH)


def test_the_guard_and_the_mps_script_spell_the_relays_names_as_the_contract():
    """The guard imports nothing of ours but its siblings, and shell imports nothing: both spell them again."""
    sys.path.insert(0, str(NODE))
    import guard_files
    c = node_contract
    assert (guard_files.MPS_TASK_DIR, guard_files.MPS_RELAY_PID, guard_files.MPS_DAEMON_PID) == \
        (c.MPS_TASK_DIR, c.MPS_RELAY_PID, c.MPS_DAEMON_PID)
    script = (NODE / "gpu-swarm-mps").read_text()
    assert f'"$mps_dir/$1/{c.MPS_DAEMON_PID}"' in script and f'"$dir/{c.MPS_NAMESPACE}"' in script
    assert f'"$mps_dir/{c.MPS_RELAY_PID}"' in script and f'"$mps_dir/{c.MPS_RELAY_LOG}"' in script and f"/{c.MPS_TASK_DIR}/control" in script
    assert f'"$here/{Path(c.MPS_RELAY_PATH).name}"' in script


@pytest.mark.parametrize("name", ["gpu_agent", "gpu_detect", "gpu_health", "health_rules", "swarm_reconciler",
                                  "mps_relay"])
def test_node_programs_import_the_contract_as_a_sibling(name):
    tree = ast.parse((NODE / f"{name}.py").read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "contract" for n in ast.walk(tree))


# ---------------------------------------------------------------- nobody else spells them



def spelled() -> dict[str, str]:
    """Value -> contract name, for every label, gpu-swarm's own node paths and the check image.

    Other programs' files (daemon.json, the toolkit's config.toml) are in the contract too, but
    stand-ins for those programs may spell them as the programs do."""
    out = {}
    for name, value in public(node_contract).items():
        ours = isinstance(value, str) and value.startswith("/") and "gpu-swarm" in value
        if isinstance(value, str) and (name.endswith("_LABEL") or ours or name == "CHECK_IMAGE"):
            out[value] = name
    return out


def literals(tree: ast.AST):
    """Every string literal (the pieces of f-strings too) but docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def words(text: str) -> list[str]:
    """Whole words only: /opt/gpu-swarm/docker is not NODE_DIR, nor /var/lib/gpu-swarm-e2e STATE_DIR."""
    return [w.rstrip(".:") for w in re.findall(r"[A-Za-z0-9_./:-]+", text)]


def spellings_in(path: Path, values: dict[str, str]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{node.lineno}: {word!r} is {values[word]}"
            for node in literals(ast.parse(path.read_text(), str(path))) for word in words(node.value)
            if word in values]


def test_spellings_are_found_whole():
    values = spelled()
    tree = ast.parse('"""gpu-swarm.pool in a docstring"""\n'
                     'a = f"--label-add gpu-swarm.pool={x} node.label=gpu-swarm.condition.reason"\n'
                     'b = "/opt/gpu-swarm/docker /var/lib/gpu-swarm-e2e gpu-swarm.poolish /etc/gpu-swarm/node.env."\n')
    found = [values[w] for n in literals(tree) for w in words(n.value) if w in values]
    assert sorted(found) == ["CONDITION_REASON_LABEL", "NODE_ENV_PATH", "POOL_LABEL"]


def test_no_other_python_file_spells_a_contract_label_or_node_path():
    values = spelled()
    assert "gpu-swarm.pool" in values and "/etc/gpu-swarm/node.env" in values
    found = []
    for path in files_git_lists(REPO, "*.py"):
        rel = path.relative_to(REPO).as_posix()
        if path == CONTRACT or rel.startswith(("tests/", "docs/")):
            continue
        found += spellings_in(path, values)
    assert not found, "import these from node/contract.py (swarm.node_contract on the program's side):\n" + \
        "\n".join(found)
