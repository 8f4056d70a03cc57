"""``python -m bluprofiler ...``: the bluprofile command."""

from bluprofiler.cli import main

main()
