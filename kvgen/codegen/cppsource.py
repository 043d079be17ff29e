"""Putting text into generated CUDA C++ source safely (the C++ twin of :mod:`kvgen.codegen.pysource`).

Only comments carry text in kvgen's CUDA files (the spec JSON of the
header). :func:`comment` JSON-escapes the text, so it is one ASCII line with
no raw newline, and keeps it from ending in a backslash: a ``//`` comment
whose line ends with ``\\`` continues onto the next line (C++ line
splicing), which would swallow the code there.
"""

from __future__ import annotations

from kvgen.codegen.pysource import escape


def comment(text: str) -> str:
    """A one-line ``//`` comment holding ``text`` escaped."""
    body = escape(text).replace('\\"', '"')  # quotes are harmless in a comment: keep JSON readable
    if body.endswith("\\"):
        body += " <-"  # never end the line with a backslash
    return "// " + body
