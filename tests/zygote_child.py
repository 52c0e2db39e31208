"""A child for tests/test_zygote.py: says who it is on the descriptor it is given, then exits with
the code it is given, or sleeps when told to (python -m tests.zygote_child FD CODE|sleep)."""

from __future__ import annotations

import json
import os
import sys
import time

preloaded = "torch" in sys.modules  # before anything here imports it
with os.fdopen(int(sys.argv[1]), "w") as answer:
    answer.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "sid": os.getsid(0),
                "cwd": os.getcwd(),
                "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
                "preloaded": preloaded,
                "stdin": sys.stdin.read(),
            }
        )
        + "\n"
    )
sys.stderr.write("said\n")
if sys.argv[2] == "sleep":
    time.sleep(3600)
sys.exit(int(sys.argv[2]))
