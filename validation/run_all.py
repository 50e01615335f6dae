"""All five experiments; writes CSVs, PNGs and REPORT.md into validation/results/.

Usage: python validation/run_all.py [--quick] [--out DIR] [--seed S] [--datasets ...] [--qkv FILE.npz]
(the options of `racecpu validate`; the work is done by racecpu.apps.validation).
"""

import os
import sys

from racecpu.apps.validation import main

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(main([*sys.argv[1:]], default_out=os.path.join(here, "results")))
