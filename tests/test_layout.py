"""The package's layout: importing the library loads no application."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Subpackages the core must never import: applications, the autograd library
#: built on the core, and the CUDA path (loaded on a device array's first call).
NOT_CORE = ("racecpu.apps", "racecpu.autograd", "racecpu.cuda")


def loaded_after(statement):
    """The racecpu modules a fresh interpreter holds after ``statement``, run from the repo root."""
    code = f"{statement}; import sys; print(sorted(m for m in sys.modules if m.startswith('racecpu')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


def test_import_racecpu_loads_no_application():
    loaded = loaded_after("import racecpu")
    assert "racecpu.attention" in loaded
    assert [m for m in loaded if m.startswith(NOT_CORE)] == []


@pytest.mark.parametrize("module", ["racecpu.outofcore", "racecpu.cli"])
def test_other_core_modules_load_no_application(module):
    loaded = loaded_after(f"import {module}")
    assert [m for m in loaded if m.startswith(NOT_CORE)] == []
