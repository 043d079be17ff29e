"""The rank plumbing of benchmarks/tp_scaling.py: spawning N ranks with a deadline, each rank's device and
process group (NCCL on cuda:r, or gloo on the CPU with the Triton interpreter), collectives on Python objects,
and the JSON header and writes both parts share. Every rank keeps NVLink multicast off (SAFE_ENV)."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time

import torch

# Never let NCCL or PyTorch use NVLink multicast (it can take a shared host's GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CPU_NOTE = "CPU (Triton interpreter) smoke run: the timings below mean nothing"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_rank(rank: int, world: int, opts: dict) -> torch.device:
    """Environment, device and process group of one rank."""
    import datetime

    import torch.distributed as dist

    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    if opts["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    kwargs = {"device_id": dev} if opts["backend"] == "nccl" else {}
    dist.init_process_group(opts["backend"], init_method=f"tcp://127.0.0.1:{opts['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=opts["pg_timeout"]), **kwargs)
    return dev


def barrier(opts: dict, rank: int) -> None:
    import torch.distributed as dist

    if opts["backend"] == "nccl":
        dist.barrier(device_ids=[rank])
    else:
        dist.barrier()


def gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:400]}"


def run_header(opts: dict, world: int) -> dict:
    import triton
    import transformers

    gpu = torch.cuda.get_device_name() if opts["device"] == "cuda" else "cpu"
    return dict(gpu=gpu, gpus=world, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, date=dt.date.today().isoformat(), backend=opts["backend"],
                device=opts["device"], command=opts["command"],
                note=CPU_NOTE if opts["device"] == "cpu" else None)


def write_json(path: str, obj: dict) -> None:
    from kvgen.atomic import write_atomic

    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def spawn(fn, world: int, opts: dict, deadline_s: float) -> str | None:
    """Run fn(rank, world, opts) on ``world`` spawned ranks; None, or why they did not all finish."""
    import torch.multiprocessing as mp

    opts = dict(opts, port=free_port())
    ctx = mp.start_processes(fn, args=(world, opts), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > end:
                for p in ctx.processes:  # only the ranks started here
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                return f"stopped after its {deadline_s:.0f} s deadline"
    except Exception as exc:  # a rank raised or died
        return error_text(exc)
    return None
