"""Experiment: int8 decode with both products on int8 tensor cores (two-limb float operand).

Registered as an extra plugin (scheme ``int8mma``: int8's layout and
reference, these macros), so it runs through the same decode template and
benchmark as the built-ins. ``python -m benchmarks.experiments.int8mma``
checks it against the reference on the current device and times it next to
``int8`` and ``bf16``.
"""

import importlib.resources
import math
import sys
from pathlib import Path

import torch

from kvgen.plugin_api import hookimpl
from kvgen_plugins.fp8 import Fp8Scheme
from kvgen_plugins.int8 import Int8Scheme


class Int8MMA(Int8Scheme):
    name = "int8mma"
    macro_template = "int8mma.j2"


class Fp8MMA(Fp8Scheme):
    name = "fp8mma"
    macro_template = "fp8mma.j2"


class Plugin:
    @hookimpl
    def kvgen_register_schemes(self, register):
        register(Int8MMA())
        register(Fp8MMA())

    @hookimpl
    def kvgen_register_templates(self, register):
        register(Path(__file__).parent / "macros")


def main():
    from kvgen.codegen.loader import load_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen.registry import load_registry

    reg = load_registry(extra_plugins=(Plugin(),))
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    B, L, Hq, Hkv, D = (32, 4096, 64, 8, 128) if cuda else (2, 80, 16, 2, 64)
    dtype = torch.bfloat16 if cuda else torch.float16
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import run as bench_run

    bench_run.PAGE = 16
    results = {}
    names = ("bf16", "int8", "int8mma", "fp8", "fp8mma") if cuda else ("fp16", "int8", "int8mma")
    for name in names:
        scheme = reg.schemes[name]
        spec = KernelSpec(op="decode", scheme=name, head_dim=D, num_kv_heads=Hkv, gqa_group=Hq // Hkv, page_size=16,
                          compute_dtype=str(dtype).split(".")[1], arch="sm_90" if cuda else "cpu")
        mod = load_kernel(spec, scheme, reg)
        if cuda:
            case = bench_run.DecodeCase(scheme, B, L, Hq, Hkv, D, dtype=dtype)
        else:
            case = _cpu_case(scheme, B, L, Hq, Hkv, D, dtype)
        out = torch.full_like(case.q, float("nan"))
        cfgs = mod.candidates(B, L) if cuda else [mod.default_config(B, L)]
        best = None
        for cfg in cfgs:
            try:
                run = lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, 1 / math.sqrt(D), cfg)
                run()
                ms = bench_run.bench(run, rep_ms=60) if cuda else 0.0
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            except Exception as exc:
                print("  fail", cfg, type(exc).__name__, str(exc)[:200])
        if best is None:
            print(f"{name:8} every candidate failed", flush=True)
            continue
        mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, 1 / math.sqrt(D), best[1])
        err = bench_run.rel_l2(out.float(), case.reference())
        ms = bench_run.bench(lambda: mod.launch(case.q, out, case.pools, case.block_tables, case.seq_lens, case.num_compressed, 1 / math.sqrt(D), best[1])) if cuda else 0.0
        results[name] = ms
        print(f"{name:8} ms {ms:.4f}  err vs fp32 {err:.5f}  bytes {getattr(case, 'bytes', 0)}  cfg {best[1]}", flush=True)
    return results


def _cpu_case(scheme, B, L, Hq, Hkv, D, dtype):
    """Small CPU version of benchmarks.run.DecodeCase (interpreter-sized)."""
    from types import SimpleNamespace

    from kvgen.runtime.pools import allocate_pool

    P = 16
    pages = -(-L // P)
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in scheme.page_tensors(D, P)]
    pools = allocate_pool(tensors, B * pages, Hkv, dtype, "cpu")
    perm = torch.randperm(B * pages).to(torch.int32).view(B, pages)
    k = torch.randn(B, Hkv, pages * P, D)
    v = torch.randn(B, Hkv, pages * P, D)
    for b in range(B):
        kp = k[b].view(Hkv, pages, P, D).transpose(0, 1).reshape(-1, P, D)
        vp = v[b].view(Hkv, pages, P, D).transpose(0, 1).reshape(-1, P, D)
        for n, t in scheme.quantize_page(kp, vp).items():
            pools[n][perm[b].long()] = t.view(pages, Hkv, *t.shape[1:]).to(pools[n].dtype)
    q = torch.randn(B, Hq, D).to(dtype)
    G = Hq // Hkv

    def reference():
        kk, vv = k[:, :, :L], v[:, :, :L]
        qq = q.float().view(B, Hkv, G, D)
        s = torch.einsum("bhgd,bhld->bhgl", qq, kk) / math.sqrt(D)
        return torch.einsum("bhgl,bhld->bhgd", s.softmax(-1), vv).reshape(B, Hq, D)

    return SimpleNamespace(q=q, pools=pools, block_tables=perm, seq_lens=torch.full((B,), L, dtype=torch.int32),
                           num_compressed=torch.full((B,), pages, dtype=torch.int32), reference=reference)


if __name__ == "__main__":
    main()
