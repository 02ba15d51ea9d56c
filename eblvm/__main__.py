"""``python -m eblvm``: the command line as a module (what torchrun launches:
``torchrun --nproc-per-node G -m eblvm run RECIPE``)."""

from eblvm_core.cli import main

main()  # its exit status is the command's (typer exits with it)
