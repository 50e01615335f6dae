"""The command line: the demo runs end to end and checks itself against the exact references."""

import subprocess
import sys


def test_demo_small_runs_and_checks_itself():
    r = subprocess.run([sys.executable, "-m", "racecpu.cli", "demo", "--tokens", "3000", "--heads", "2",
                        "--dim", "16", "--samples", "6", "--causal"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ns per token-head" in r.stdout
    assert "peak RSS" in r.stdout
    assert "all outputs and gradients finite: True" in r.stdout
    err = float(r.stdout.split("float64): ")[1].split()[0])
    assert err < 1e-4


def test_help_lists_subcommands():
    r = subprocess.run([sys.executable, "-m", "racecpu.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout
