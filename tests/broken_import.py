"""A user module whose import fails (a missing dependency), for CLI error tests."""

import autotune_no_such_dependency  # noqa: F401
