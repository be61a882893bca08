"""pytest configuration for the default test run."""

# tests/parity/ needs a separate venv with vLLM installed (`make parity`); never
# collected by the default `make test`.
collect_ignore = ["parity"]
