"""Experiment 1: one table's soft RACE kernel vs (1 - theta/pi)^P; bias vs the paper's bound; variance vs 1/L.

Usage: python validation/kernel_level.py [--quick] [--out DIR] [--seed S] [--datasets ...] [--qkv FILE.npz]
(the options of `racecpu validate`; the work is done by racecpu.apps.validation).
"""

import os
import sys

from racecpu.apps.validation import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(["--only", "kernel", *sys.argv[1:]], default_out=os.path.join(here, "results")))
