"""``python -m eblvm``, the eblvm command line as a module: what torchrun launches
(``torchrun --nproc-per-node G -m eblvm run RECIPE``)."""

import sys

from eblvm_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
