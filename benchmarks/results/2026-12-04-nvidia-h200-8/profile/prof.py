"""Per-kernel counts and durations inside the int4 decode graphs at B=32 2K (32 steps: two converting steps)."""
import collections, json, os
import torch
from torch.profiler import ProfilerActivity, profile
from benchmarks.engine import filled_engine, log, timed_steps

OUT = os.environ["OUT"]
eng = filled_engine("int4", 32, 2048, 2048 + 400, async_scheduling=True)
for _ in range(8):
    eng.step()
log(f"lens {[s.num_computed for s in eng.scheduler.running][:4]}")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    ms = timed_steps(eng, 32)
ev = collections.defaultdict(list)
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA and e.name and not e.name.startswith(("Memcpy", "Memset")):
        ev[e.name[:90]].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
rows = []
for k, v in sorted(ev.items(), key=lambda kv: -sum(kv[1])):
    v = sorted(v)
    rows.append(dict(name=k, n=len(v), total_per_step_us=sum(v) / 32, mean=sum(v) / len(v), p50=v[len(v) // 2],
                     max=v[-1], top=v[-8:]))
    log(f"{sum(v)/32:9.1f} us/step  n={len(v):5d} mean={sum(v)/len(v):7.2f} p50={v[len(v)//2]:7.2f} max={v[-1]:8.2f}  {k}")
log(f"step {ms:.3f} ms; converted steps {eng.runner.graphs.converted_steps}")
json.dump(dict(step_ms=ms, rows=rows), open(f"{OUT}/prof.json", "w"), indent=1)
