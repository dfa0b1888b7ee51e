"""What the program hands to providers does not depend on the operator's machine: a Windows one gives the same.

pulumi-command's CopyToRemote builds remote paths with the operator's separator
(pulumi/pulumi-command#888): the program copies nothing (the nodes download their bundle), and
no input holds a path of this machine. Text the program reads is read as UTF-8, not in the
operator's locale (Python on Windows reads cp1252 by default), and .gitattributes keeps LF
line endings in what the nodes run, whatever core.autocrlf says.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, request_inputs, run_program, stack_config, unwrap

# The program's own modules: what `pulumi up` runs on the operator's machine (swarm/ renders
# the scripts and reads the stack files).
PROGRAM = [REPO / "__main__.py", REPO / "to_node" / "software.py", REPO / "to_node" / "commands.py",
           *sorted((REPO / "components").glob("*.py")), *sorted((REPO / "settings").glob("*.py")),
           *sorted((REPO / "swarm").glob("*.py"))]
DRIVE_PATH = re.compile(r"\b[A-Za-z]:\\\\[^\s\"']+")


@pytest.fixture(scope="module", params=["dev", "prod"])
def run(request):
    return run_program(stack_config(request.param), stack=request.param)


def test_no_input_holds_a_path_of_the_operators_machine(run):
    for name, request in run.monitor.requests.items():
        text = json.dumps(unwrap(request_inputs(request)))
        assert str(REPO) not in text, name
        assert not DRIVE_PATH.search(text), name


def test_nothing_is_copied_from_the_operators_disk(run):
    types = {r.type for r in run.monitor.requests.values()}
    assert not types & {"command:remote:CopyToRemote", "command:remote:CopyFile", "command:local:Command"}
    for name, request in run.monitor.requests.items():
        text = json.dumps(request_inputs(request))
        # Pulumi's asset and archive signatures: a FileAsset would carry a local path.
        assert "c44067f5952c0a294b673a41bacd8c17" not in text and "0def7320c3a5731c473e5ecbe6d01bc7" not in text, name


def test_the_program_reads_its_files_as_utf8_not_in_the_operators_locale():
    unpinned = []
    for path in PROGRAM:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("read_text", "write_text") and \
                    not any(k.arg == "encoding" for k in node.keywords):
                unpinned.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert unpinned == []


def test_what_the_nodes_run_keeps_lf_line_endings_on_any_checkout():
    rules = (REPO / ".gitattributes").read_text(encoding="utf-8")
    for pattern in ("node/** text eol=lf", "cloud-init/** text eol=lf", "stacks/** text eol=lf"):
        assert pattern in rules


def test_remote_paths_are_posix_strings():
    from swarm import node_contract
    paths = [v for k, v in vars(node_contract).items() if k.isupper() and isinstance(v, str) and v.startswith("/")]
    assert paths and all("\\" not in p and Path(p).as_posix() == p for p in paths)
