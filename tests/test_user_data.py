"""The EC2 user data: one small, constant cloud-config that real cloud-init accepts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from components.user_data import NVIDIA_PACKAGES, UNATTENDED_CONFIG, render_user_data
from tests.tools import require_tool

REPO = Path(__file__).resolve().parent.parent


def test_real_cloud_init_accepts_it(tmp_path):
    cloud_init = require_tool("cloud-init")
    path = tmp_path / "user-data"
    path.write_text(render_user_data())
    result = subprocess.run([cloud_init, "schema", "--config-file", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_starts_with_the_header_and_stays_small():
    text = render_user_data()
    assert text.startswith("#cloud-config\n")  # cloud-init ignores the whole document otherwise
    assert len(text.encode()) < 1024  # EC2 allows 16 KiB; the software travels over SSH


def test_it_keeps_unattended_upgrades_off_nvidia_packages_from_the_first_boot():
    (entry,) = yaml.safe_load(render_user_data())["write_files"]
    assert entry["path"] == UNATTENDED_CONFIG
    for package in NVIDIA_PACKAGES:
        assert f'"{package}";' in entry["content"]
    assert "Unattended-Upgrade::Package-Blacklist" in entry["content"]


def test_same_bytes_in_any_process_and_hash_seed():
    code = "import sys; from components.user_data import render_user_data; sys.stdout.write(render_user_data())"
    outputs = {subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outputs == {render_user_data()}


def test_it_is_plain_text_not_a_compressed_blob():
    # Compressed bytes depend on the operator's zlib and OS (the gzip header's OS byte).
    assert render_user_data().isascii()
