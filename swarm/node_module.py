"""Loads one of node/'s Python files by path, as its own module.

node/ lands on every node, where its programs import each other as siblings; the program reads
the same files here (the GPU resource rules, the contract), so that there is no second copy.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NODE_DIR = Path(__file__).resolve().parent.parent / "node"


def load(filename: str, module_name: str) -> ModuleType:
    """Registered in sys.modules under module_name first, as an import does: dataclasses look their
    module up there while the file runs."""
    spec = importlib.util.spec_from_file_location(module_name, NODE_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
