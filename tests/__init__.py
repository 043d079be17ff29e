"""kvgen's tests, one package: nothing under tests/ becomes a top-level module.

Without this file pytest put tests/ itself on sys.path, so ``tests/kernels``
was importable as ``kernels`` and shadowed Hugging Face's ``kernels``
distribution, which transformers 5.25 imports while loading a config.
"""
