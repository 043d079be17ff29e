"""Putting text into generated Python source safely.

Generated files hold strings that come from users (a model's folder name,
a config file's stem, ``_name_or_path``, a target's name). They enter the
source only through these functions, which JSON-escape them: every quote,
backslash, control character and non-ASCII character becomes an escape that
means the same inside a Python string literal, so the text can neither close
the literal nor start a new line of code. Identifiers that enter code as
code (op, scheme and tensor names) are validated where they are made
(:class:`~kvgen.codegen.spec.KernelSpec`, :mod:`kvgen.codegen.layout`).
"""

from __future__ import annotations

import json


def escape(text: str) -> str:
    """``text`` as the body of a ``"..."`` or ``\"\"\"...\"\"\"`` literal: ASCII only, no quote, no line break."""
    return json.dumps(str(text), ensure_ascii=True)[1:-1]


def docstring(*lines: str) -> str:
    """A triple-quoted literal whose value is ``lines`` joined by newlines (with a final newline).

    Each line is escaped on its own (so a user's newline cannot end the
    literal either); the literal spans one source line per given line.
    """
    return '"""' + "\n".join(escape(line) for line in lines) + '\n"""'


def comment(text: str) -> str:
    """A one-line ``#`` comment holding ``text`` escaped (a newline in ``text`` cannot start code)."""
    return "# " + escape(text)
