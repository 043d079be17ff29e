"""Knock-out timing (kept as run; PYTHONPATH=. python knockout.py, OUT set): the int4 engine step at B=32 and 2K
with one kind of small kernel replaced by nothing (garbage output, timing only), alternating with the unmodified
graphs (ABA); then the same on graphs without attention. Writes $OUT/knockout.json."""
import gc, json, os, sys, types
import torch
from benchmarks.engine import filled_engine, log, timed_steps, weight_bytes, release
from benchmarks.run import copy_bandwidth
import kvgen.engine.fused as fused
from kvgen.engine.graphs import DecodeGraphs

OUT = os.environ["OUT"]
orig = {n: getattr(fused, n) for n in ("silu_mul", "qkv_rope", "add_rms_norm")}
import kvgen.engine.gemv as gemv
orig_gated = gemv.gated_linear


def unfused(x, w, b=None):
    return fused.silu_mul(gemv.linear(x, w, b))


def check_gated(eng):
    mlp = eng.runner.model.model.layers[0].mlp
    for m in (5, 16, 32):
        x = torch.randn(m, mlp.gate_up_weight.shape[1], device="cuda", dtype=torch.bfloat16)
        a, b = orig_gated(x, mlp.gate_up_weight, mlp.gate_up_bias), unfused(x, mlp.gate_up_weight, mlp.gate_up_bias)
        log(json.dumps(dict(check="gated", m=m, equal=bool(torch.equal(a, b)),
                            max_diff=float((a.float() - b.float()).abs().max()))))


def no_silu(gu):
    return torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=gu.device)


def no_rope(qkv, positions, cos, sin, hq, hkv, d, *a, **k):
    T = qkv.shape[0]
    buf = torch.empty(T * (hq + 2 * hkv) * d, dtype=qkv.dtype, device=qkv.device)
    return (buf[:T * hq * d].view(T, hq, d), buf[T * hq * d:T * (hq + hkv) * d].view(T, hkv, d),
            buf[T * (hq + hkv) * d:].view(T, hkv, d))


def no_norm(x, residual, w, eps):
    return (torch.empty_like(x), x if residual is None else residual)


NOOP = types.SimpleNamespace(launch=lambda *a, **k: None)


def run(kv, B, L, variants, steps=24):
    eng = filled_engine(kv, B, L, L + 2 * 2 * len(variants) * 60 + 256, async_scheduling=True)
    check_gated(eng)
    kern = dict(eng.cache.kernels)
    recs = []
    base = variants[0]
    order = [base] + [v for x in variants[1:] for v in (x, base)]
    for rnd in range(2):
        for name, patch in order:
            for n, f in orig.items():
                setattr(fused, n, f)
            gemv.gated_linear = orig_gated
            eng.cache.kernels.clear(); eng.cache.kernels.update(kern)
            patch(eng)
            eng.runner.graphs = None
            gc.collect(); torch.cuda.empty_cache()
            eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, B, eng.max_model_len, verbose=False)
            for _ in range(4):
                eng.step()
            ms = min(timed_steps(eng, steps) for _ in range(2))
            ctx = int(eng.scheduler.running[0].num_computed) if eng.scheduler.running else -1
            rec = dict(kv=kv, B=B, L=L, variant=name, round=rnd, ms=ms, ctx=ctx)
            log(json.dumps(rec)); recs.append(rec)
    for n, f in orig.items():
        setattr(fused, n, f)
    holder = [eng]; del eng; release(holder)
    return recs


def set_(attr, f):
    return lambda eng: setattr(fused, attr, f)


def kernel_off(*names):
    def p(eng):
        for n in names:
            if n in eng.cache.kernels:
                eng.cache.kernels[n] = NOOP
    return p


def combo(*ps):
    def p(eng):
        for q in ps:
            q(eng)
    return p


def unfuse(eng):
    gemv.gated_linear = unfused


ATT = kernel_off("decode")
V = [("base", lambda e: None), ("unfused_silu", unfuse), ("no_rope", set_("qkv_rope", no_rope)),
     ("no_write", kernel_off("cache_write")), ("no_write_quantize", kernel_off("cache_write", "page_quantize")),
     ("no_norm", set_("add_rms_norm", no_norm)),
     ("no_small", combo(set_("qkv_rope", no_rope), set_("add_rms_norm", no_norm),
                        kernel_off("cache_write", "page_quantize")))]
VA = [("no_attn", ATT), ("no_attn+unfused_silu", combo(ATT, unfuse)), ("no_attn+no_rope", combo(ATT, set_("qkv_rope", no_rope))),
      ("no_attn+no_write", combo(ATT, kernel_off("cache_write", "page_quantize"))),
      ("no_attn+no_norm", combo(ATT, set_("add_rms_norm", no_norm)))]
if __name__ == "__main__":
    bw = copy_bandwidth()
    recs = run("int4", 32, 2048, V)
    recs += run("int4", 32, 2048, VA)
    json.dump(dict(bw=bw, records=recs), open(f"{OUT}/knockout.json", "w"), indent=1)
