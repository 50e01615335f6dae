"""Experiment 4: assumption (A1) s_min/N and (A2) ||S||_2/N for every data set.

Usage: python validation/assumption_a1.py [--quick] [--out DIR] [--seed S] [--datasets ...] [--qkv FILE.npz]
(the options of `racecpu validate`; the work is done by racecpu.apps.validation).
"""

import os
import sys

from racecpu.apps.validation import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(["--only", "assumptions", *sys.argv[1:]], default_out=os.path.join(here, "results")))
