"""pytest configuration for the default test run."""
import signal

# tests/parity/ needs a separate venv with vLLM installed (`make parity`); never
# collected by the default `make test`.
collect_ignore = ["parity"]

# Several tests stop a `kvdrain serve` or replay child with SIGINT, as Ctrl-C would. A test
# run started in the background by a non-interactive shell has SIGINT ignored (POSIX), and
# every child would inherit that and never stop: Ctrl-C's usual handler, for this process
# and so for its children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
