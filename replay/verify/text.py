"""Text kvdrain did not write, as its output shows it: escaped. Runs in: every kvdrain process.

A server's error body, a header, a metric's label, a vLLM log line, a client's request:
any of them may hold escape sequences (clear the screen, set the terminal's title) or
bidi overrides. Every such text kvdrain prints, logs or puts in an exception goes
through printable() first.
"""

from __future__ import annotations

import unicodedata

HIDDEN = ("Cc", "Cf", "Cs")  # control, format (bidi overrides, zero-width), lone surrogates


def printable(text: object, limit: int = 200) -> str:
    """A peer's text made safe for a terminal: control and format characters (escape
    codes, bidi overrides) written as Python escapes, at most `limit` characters."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    return "".join(
        c if unicodedata.category(c) not in HIDDEN or c == " " else ascii(c)[1:-1] for c in text
    )
