"""Real tools the tests run: present in CI (which installs them), optional elsewhere."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def require_tool(name: str) -> str:
    """The tool's path; without it the test fails in CI (CI=true) and skips elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian package {name})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return path


def files_git_lists(repo: Path, pattern: str) -> list[Path]:
    """Every file matching pattern that git tracks or would track (so never .venv)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", pattern],
                                cwd=repo, capture_output=True, text=True, check=True).stdout
        paths = [repo / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        paths = [p for p in repo.rglob(pattern) if not {".git", ".venv"} & set(p.relative_to(repo).parts)]
    return sorted(p for p in paths if p.is_file())
