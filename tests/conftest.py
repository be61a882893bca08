"""pytest configuration for the default test run."""

import os
import signal

# One compute thread per process (torch's intra-op pool and OpenMP), set before torch is
# imported and inherited by every engine the tests spawn: on a loaded 2-core machine a
# pool of spinning threads per process made a 0.1 s model test take 13 s (and the suite
# 26 min instead of 10). No test measures speed; results do not depend on the count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# tests/parity/ needs a separate venv with vLLM installed (`make parity`); never
# collected by the default `make test`.
collect_ignore = ["parity"]

# Several tests stop a `kvdrain serve` or replay child with SIGINT, as Ctrl-C would. A test
# run started in the background by a non-interactive shell has SIGINT ignored (POSIX), and
# every child would inherit that and never stop: Ctrl-C's usual handler, for this process
# and so for its children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
