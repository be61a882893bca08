"""Where the tests find the repository and its bundled files."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd_idle.jsonl"
