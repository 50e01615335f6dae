"""Run the racecpu benchmark suite: ``python benchmarks/run.py [flags]`` = ``racecpu bench [flags]``.

See ``racecpu bench --help`` and the docstring of :mod:`racecpu.apps.bench` for what is
measured, the roofline derivation and the skip caps.  Results go to
``benchmarks/results/`` (``--out`` to change).
"""

import sys

from racecpu.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
