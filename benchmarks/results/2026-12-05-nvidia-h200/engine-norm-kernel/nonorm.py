"""What ran (PYTHONPATH=. python nonorm.py --parts step --no-hf --async-only --kv int4,bf16 --step-shapes 32x2048
[or 1x16384]) at 97be868: benchmarks.engine with gemv.residual_linear declining everywhere, i.e. the residual add +
RMSNorm as its own kernel. The run's copy took its declining stand-in from step_ab (``_declined``, gone since);
here it is inlined, the same function. Since the next commit that is the default (gemv.FUSED_NORM = False)."""
import runpy
import sys

from kvgen.engine import gemv

gemv.residual_linear = lambda *args, **kwargs: None
sys.argv = ["benchmarks.engine"] + sys.argv[1:]
runpy.run_module("benchmarks.engine", run_name="__main__")
