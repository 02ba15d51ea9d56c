"""``python -m eblvm``: the command line as a module (what torchrun launches:
``torchrun --nproc-per-node G -m eblvm run RECIPE``)."""

import sys

from eblvm_core.cli import main

sys.exit(main())
