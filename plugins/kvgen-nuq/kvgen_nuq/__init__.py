"""kvgen-nuq: the ``nuq4`` KV-cache scheme for kvgen, as a third-party plugin.

Non-uniform 4-bit keys (per-channel normalization over each page, a 16-level
k-means codebook, the top 1% of each token's entries kept in float16) and
KIVI-style uniform 4-bit values. See :mod:`kvgen_nuq.scheme` for the layout,
:mod:`kvgen_nuq.plugin` for the hooks, and ``kvgen nuq calibrate`` to fit a
codebook on your own model.
"""

__version__ = "0.1.0"
