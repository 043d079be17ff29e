"""kvgen: a compiler for KV-cache attention.

The pipeline (see ARCHITECTURE in the docs): ModelSpec + Target + Workload
-> planner -> Plan -> codegen (KernelSpec per op, Jinja templates) ->
generated package -> runtime.
"""

__version__ = "0.1.0"

_ENGINE_EXPORTS = ("LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str):
    # ``from kvgen import LLM, SamplingParams`` as in vLLM; torch loads only when one of them is used,
    # so ``import kvgen`` (every CLI command) stays light.
    if name in _ENGINE_EXPORTS:
        import kvgen.engine

        return getattr(kvgen.engine, name)
    raise AttributeError(f"module 'kvgen' has no attribute {name!r}")
