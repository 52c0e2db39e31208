"""`python -m autotune.cli`: the same as the `autotune` command."""

from autotune.cli import main

main()
