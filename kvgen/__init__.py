"""kvgen: a compiler for KV-cache attention.

The pipeline (see ARCHITECTURE in the docs): ModelSpec + Target + Workload
-> planner -> Plan -> codegen (KernelSpec per op, Jinja templates) ->
generated package -> runtime.
"""

__version__ = "0.1.0"
