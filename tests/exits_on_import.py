"""A user module that calls sys.exit(3) when imported (a script without a __main__ guard)."""

import sys

sys.exit(3)
