"""Experiment 2: RMS error of race_attention vs angular_attention(gamma=P) against L, beta and N (non-causal and causal).

Usage: python validation/theorem_terms.py [--quick] [--out DIR] [--seed S] [--datasets ...] [--qkv FILE.npz]
(the options of `racecpu validate`; the work is done by racecpu.apps.validation).
"""

import os
import sys

from racecpu.apps.validation import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main(["--only", "theorem", *sys.argv[1:]], default_out=os.path.join(here, "results")))
