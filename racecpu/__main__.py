"""``python -m racecpu``: the ``racecpu`` command line (see :mod:`racecpu.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
