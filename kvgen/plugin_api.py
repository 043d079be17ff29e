"""What a plugin imports: the hook marker and the contracts it implements."""

import pluggy

from kvgen.errors import KvgenError, SchemeCapabilityError, SchemeOptionError
from kvgen.schemes import COMPUTE, D, P, PageTensor, Scheme

hookimpl = pluggy.HookimplMarker("kvgen")

__all__ = ["hookimpl", "KvgenError", "SchemeCapabilityError", "SchemeOptionError", "Scheme", "PageTensor", "COMPUTE",
           "D", "P"]
