"""Every Triton launch kvgen makes states its compile options (FP fusion on; templates/triton/launch_options.j2
says why), in the generated kernels and in the engine's fused kernels alike: left to Triton's default, triton
3.9 warns at each process's first compile, and 3.10 would compile the kernels without FMAs."""

from __future__ import annotations

import types

import torch

from kvgen.engine import fused

from .test_runtime import D, H, HQ, kernels_for, make_cache


class Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records (name, kwargs), then launches."""

    def __init__(self, name: str, kernel, seen: list):
        self.name, self.kernel, self.seen = name, kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((self.name, dict(kwargs)))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _triton_kernels(module) -> dict:
    return {n: getattr(module, n) for n in dir(module)
            if n.endswith("_kernel") and callable(getattr(getattr(module, n), "__getitem__", None))}


def test_every_launch_of_the_generated_kernels_passes_the_compile_options(monkeypatch):
    seen: list = []
    kernels = kernels_for("int4")  # a residual scheme: cache write, page quantize, decode, prefill, page copy
    for op, module in kernels.items():
        assert module.COMPILE_OPTIONS == fused.COMPILE_OPTIONS, op
        for name, kernel in _triton_kernels(module).items():
            monkeypatch.setattr(module, name, Recorder(name, kernel, seen))
    cache = make_cache("int4", max_tokens=1024, num_layers=1)
    gen = torch.Generator().manual_seed(0)
    cache.add("a")
    for counts, mode in (([150], "fresh"), ([1], "decode"), ([5], "pages")):
        cache.plan_step(["a"], counts)
        q, k, v = (torch.randn(counts[0], n, D, generator=gen) for n in (HQ, H, H))
        if mode == "fresh":
            cache.prefill(0, q, k, v, ["a"])
        else:
            cache.append_kv(0, ["a"], k, v)
            cache.decode(0, q, ["a"]) if mode == "decode" else cache.prefill(0, q, None, None, ["a"])
    cache.fork("a", "b")
    cache.plan_step(["b"], [1])  # the fork's copy-on-write of its shared partial page
    cache.append_kv(0, ["b"], *(torch.randn(1, H, D, generator=gen) for _ in range(2)))
    launched = {name for name, _ in seen}
    assert {"_cache_write_kernel", "_page_quantize_kernel", "_decode_kernel", "_prefill_kernel"} <= launched, launched
    missing = [(name, kw) for name, kw in seen if kw.get("enable_fp_fusion") is not True]
    assert not missing, missing


def test_every_launch_of_the_engines_fused_kernels_passes_the_compile_options(monkeypatch):
    monkeypatch.delenv("KVGEN_FUSED_TORCH", raising=False)
    x = torch.randn(3, 64)
    real = fused._impl(x)
    assert real is not None, "the fused Triton kernels should run here (interpreter, CPU tensors)"
    seen: list = []
    wrapped = types.SimpleNamespace(INTERPRET=real.INTERPRET,
                                    **{n: Recorder(n, k, seen) for n, k in _triton_kernels(real).items()})
    monkeypatch.setattr(fused, "_impl", lambda t: wrapped)
    fused.add_rms_norm(x, torch.randn(3, 64), torch.ones(64), 1e-6)
    fused.silu_mul(torch.randn(3, 128))
    T, Hq, Hkv, Dh = 2, 4, 2, 16
    cos, sin = torch.randn(8, Dh // 2), torch.randn(8, Dh // 2)
    fused.qkv_rope(torch.randn(T, (Hq + 2 * Hkv) * Dh), torch.tensor([0, 1]), cos, sin, Hq, Hkv, Dh)
    assert {name for name, _ in seen} == set(_triton_kernels(real)), seen
    assert all(kw.get("enable_fp_fusion") is True for _, kw in seen), seen
