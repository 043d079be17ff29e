"""(ab2) A/B in one process: RoPE in the q/k/v GEMM epilogue or not. (was:) A/B in one process, int4 B=32 2K (and B=1 16K): the new graphs (conversions after attention on a side stream,
gated SiLU) against the old order and the unfused SiLU, alternating to cancel the context's drift."""
import gc, json, os
import torch
import kvgen.engine.fused as fused
import kvgen.engine.gemv as gemv
from kvgen.engine.graphs import DecodeGraphs
from benchmarks.engine import filled_engine, log, timed_steps, release

OUT = os.environ["OUT"]
gated = gemv.gated_linear
fused_rope = gemv.qkv_rope_linear


def rope_apart(x, w, b, pos, cos, sin, hq, hkv, d):
    return fused.qkv_rope(gemv.linear(x, w, b), pos, cos, sin, hq, hkv, d)


def unfused(x, w, b=None):
    return fused.silu_mul(gemv.linear(x, w, b))


VARIANTS = {"rope_fused": fused_rope, "rope_apart": rope_apart}


def run(kv, B, L, rounds=3, steps=24):
    eng = filled_engine(kv, B, L, L + rounds * len(VARIANTS) * (steps * 2 + 4) + 256, async_scheduling=True)
    recs = []
    for rnd in range(rounds):
        for name, fn in VARIANTS.items():
            gemv.qkv_rope_linear = fn
            after = True
            eng.runner.graphs = None
            gc.collect(); torch.cuda.empty_cache()
            eng.runner.graphs = DecodeGraphs(eng.runner.model, eng.cache, B, eng.max_model_len, verbose=False,
                                             conversions_after_attention=after)
            for _ in range(4):
                eng.step()
            c0 = eng.runner.graphs.converted_steps
            ms = min(timed_steps(eng, steps) for _ in range(2))
            rec = dict(kv=kv, B=B, L=L, variant=name, round=rnd, ms=ms,
                       ctx=eng.scheduler.running[0].num_computed, converted=eng.runner.graphs.converted_steps - c0)
            log(json.dumps(rec)); recs.append(rec)
    gemv.qkv_rope_linear = fused_rope
    holder = [eng]; del eng; release(holder)
    return recs


recs = run("int4", 32, 2048, rounds=3)
json.dump(recs, open(f"{OUT}/ab2.json", "w"), indent=1)
