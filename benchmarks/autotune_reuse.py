"""Autotune persistence on the GPU: the first process tunes, a second one reuses.

    python -m benchmarks.autotune_reuse [--out DIR]

Runs the same decode step (B=32, L=4096, Llama-3-70B shard: 64/8 heads,
D=128, int8 pages, one layer) in two fresh processes sharing one
KVGEN_CACHE_DIR, and prints the wall time of each process's first decode
call (tuning included) and whether the second process timed any candidate.
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def child(out_dir: str) -> None:
    import torch

    from kvgen.codegen.package import compile_plan
    from kvgen.integrations.transformers import import_package
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target

    B, L = 32, 4096
    plan = make_plan(resolve_model("llama-3-70b"), resolve_target("h200"), Workload(context=L, concurrency=B, tp=1),
                     default_registry().schemes, kv="int8")
    pkg = import_package(compile_plan(plan, out_dir).out_dir)
    cache = pkg.load(device="cuda", max_tokens=B * L + 4096, num_layers=1, autotune=True, max_seqs=B)
    ids = list(range(B))
    for i in ids:
        cache.add(i)
    kv = lambda n: torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
    # plan_step looks up (on a miss: tunes) the step's kernel config for its shape bucket.
    t0 = time.perf_counter()
    cache.plan_step(ids, L - 1)
    prefill_plan_s = time.perf_counter() - t0
    cache.append_kv(0, None, kv(B * (L - 1)), kv(B * (L - 1)))
    t0 = time.perf_counter()
    cache.plan_step(ids, 1)
    decode_plan_s = time.perf_counter() - t0
    cache.append_kv(0, None, kv(B), kv(B))
    q = torch.randn(B, 64, 128, device="cuda", dtype=torch.bfloat16)
    out = cache.decode(0, q, None)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(10):
        cache.decode(0, q, None)
    torch.cuda.synchronize()
    print(json.dumps({"prefill_plan_step_s": prefill_plan_s, "decode_plan_step_s": decode_plan_s,
                      "decode_config": cache.step.configs.get("decode"), "steady_decode_ms": (time.perf_counter() - t1) / 10 * 1e3,
                      "finite": bool(torch.isfinite(out).all())}), flush=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    cache_dir = tempfile.mkdtemp(prefix="kvgen-autotune-")
    env = dict(os.environ, KVGEN_CACHE_DIR=cache_dir)
    results = []
    for run in ("first process (tunes)", "second process (reuses)"):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.autotune_reuse", "--child", os.path.join(cache_dir, "pkg")],
                              env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        rec = dict(json.loads(line), run=run, process_wall_s=wall, tuned=("[" in proc.stderr and "%" in proc.stderr),
                   rc=proc.returncode)
        if proc.returncode:
            rec["stderr"] = proc.stderr[-1500:]
        results.append(rec)
        print(json.dumps(rec), flush=True)
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(cache_dir, "autotune")) for f in fs]
    print(f"persisted autotune files: {files}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
