"""Where the tests find the repository and its bundled files."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd_idle.jsonl"
# The public traces (docs/traces.md, "Public traces"): `make traces` links them at traces/, or
# $KVDRAIN_TRACES names their folder. Tests that need them skip, saying where they looked.
TRACES = Path(os.environ.get("KVDRAIN_TRACES", ROOT / "traces"))
MOONCAKE = TRACES / "conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_code.csv"


def public_trace(path: Path):
    """Skip, saying why, unless `path` is there and not empty (a failed download leaves an
    empty traces/ behind)."""
    import pytest

    there = path.is_file() and path.stat().st_size > 0
    return pytest.mark.skipif(
        not there, reason=f"public trace {path.name} not at {TRACES} (`make traces` fetches it)"
    )
