"""The compiler side's view of kvgen's environment variables (see kvgen.runtime.env)."""

from kvgen.runtime.env import cache_dir, plugin_allow_list, triton_interpret

__all__ = ["cache_dir", "plugin_allow_list", "triton_interpret"]
