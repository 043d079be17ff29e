"""Engine factories for the engine process's start-up tests that import nothing heavy (no torch).

An engine process that imports only these starts in well under a second
(serve.helpers imports torch and transformers: seconds per start).
"""

from __future__ import annotations

import threading
import time


class TokenizerOnly:
    """As much of an engine as the engine process needs before it is ready: settings, the tokenizer, close()."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = 8
        self.max_model_len = 16

    def close(self) -> None:
        pass


def unsendable_tokenizer_engine():
    """An engine whose tokenizer cannot be pickled (a lock stands in for a native tokenizer object)."""
    return TokenizerOnly(threading.Lock())


def slow_engine(seconds: float):
    """An engine that takes ``seconds`` to build (then fails: no test waits that long)."""
    time.sleep(seconds)
    raise RuntimeError("built too late")
