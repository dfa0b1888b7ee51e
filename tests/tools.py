"""Real tools the tests run: present in CI (which installs them), optional elsewhere."""
from __future__ import annotations

import os
import shutil

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
