"""Tensor parallelism for the engine: one process per rank, the scheduler on rank 0 (tp=1 never loads this).

Rank 0 is the caller's process: it runs the scheduler, the sampler and its
share of the model. Ranks 1..N-1 are worker processes (``python -m
kvgen.engine.worker``, started by :class:`Workers`) holding their share of
the weights and their KV heads (see :mod:`kvgen.engine.shard`).

Each step rank 0 sends every worker one message (pickled, over a pipe): the
cache calls the scheduler and the engine made since the previous step
(``add``/``free``/``fork``/``swap_out``/``swap_in``/``plan_step``..., in
order, each marked with the exception it raised, if any), the step's token
ids and positions, a fingerprint of its StepMetadata, and whether the step
must run eagerly (pages moved between the tiers just before it: every rank
decides alike, so graph replays and their all-reduces stay in step). A
worker replays the calls on its own KVCache; the BlockManager is
deterministic, so it reaches the same page tables (the fingerprint checks
it), and then runs its share of the model.
The only tensors crossing ranks are the two all-reduces per layer
(torch.distributed: gloo on the CPU, NCCL on GPUs). Sampling happens on
rank 0 alone; the drawn tokens reach the workers as the next step's token
ids.

Control messages use pipes, not a collective: a worker waits for the next
step as long as a server idles (no collective timeout), and it exits when
rank 0's process dies (end of file). Every started process, and rank 0
before it joins the group, gets :data:`NO_MULTICAST` in its environment.

Start: rank 0 starts the workers, loads its own shard while they load
theirs, waits for every ``ready`` (a worker's loading error is raised
here, naming the rank), sends ``join``, and all ranks join the group (a
file rendezvous in a fresh temporary folder) and capture their decode
graphs together. A worker that reads end of file or ``stop`` instead of
``join`` exits: none waits in a rendezvous for a rank 0 that failed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .config import DEFAULT_ENGINE_BACKEND
from .errors import EngineError

# Never let NCCL or PyTorch use NVLink multicast (it can take a shared host's GPUs down).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
READY_TIMEOUT_S = 3600.0  # loading a large checkpoint from a slow disk


@dataclass
class RankSpec:
    """What every rank builds (picklable; rank 0 resolves it and sends it to the workers)."""

    world: int
    store: str  # a file:// rendezvous path (a fresh temporary folder: no port to race for)
    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda": rank r runs on cuda:r
    cfg: Any  # ModelConfig
    plan: Any  # the kvgen Plan (tp = world)
    folder: str | None  # checkpoint folder, or None for random weights
    seed: int
    dtype: Any  # torch.dtype
    max_tokens: int
    cache_seqs: int
    autotune: bool
    max_model_len: int
    max_num_seqs: int
    use_graphs: bool
    host_tier: dict | None = None  # the runtime load's host_tokens/staging_tokens ({} or None: no host tier)
    kernel_backend: str = DEFAULT_ENGINE_BACKEND  # the package's kernel language (rank 0 compiled it: the ranks import it)
    kernel_choice: dict | None = None  # an auto package: op -> the backend rank 0 runs (see load_cache)


def step_fingerprint(step: Any) -> tuple:
    """Host fields of a StepMetadata that two ranks with the same page tables agree on."""
    return (step.index, step.batch, step.num_new, step.seq_lens_host, step.max_pages, step.num_copies,
            step.num_conversions, len(step.phases), getattr(step, "cold", None) is not None)


class RecordingCache:
    """Rank 0's KVCache as the scheduler and engine see it: every call goes through, and is recorded.

    Every method called through it is recorded (``add``/``free``/``fork``/
    ``swap_out``/``swap_in``/``make_cold``/``wait_host_tier``/``plan_step``
    today; a later page-changing method is covered without a change here)
    except the pure queries in :data:`QUERIES`; attributes pass through. The runner attends on the real cache, so per-layer kernel
    calls never pass here. ``__wrapped__`` is the real cache (the scheduler
    finds the runtime's error classes through it). :meth:`take` hands out
    the calls since the last take: ``(pickled (name, args, kwargs),
    exception class name or None)``.
    """

    QUERIES = frozenset({"seq_len", "sequences", "kv_head_range", "q_head_range", "allocated_bytes", "read_kv",
                         "pool_tensors", "num_free_pages"})

    def __init__(self, cache: Any) -> None:
        self.__wrapped__ = cache
        self._ops: list[tuple[bytes, str | None]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__wrapped__, name)
        if name.startswith("_") or name in self.QUERIES or not callable(value):
            return value
        return lambda *args, **kwargs: self._call(name, value, args, kwargs)

    def _call(self, name: str, method: Any, args: tuple, kwargs: dict) -> Any:
        # Pickled now: the arguments are the scheduler's lists, which may change before the next step.
        op = pickle.dumps((name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            result = method(*args, **kwargs)
        except Exception as e:
            self._ops.append((op, type(e).__name__))  # a failed call is replayed too (and must fail there)
            raise
        self._ops.append((op, None))
        return result

    def take(self) -> list[tuple[bytes, str | None]]:
        ops, self._ops = self._ops, []
        return ops


def replay(cache: Any, ops: list[tuple[bytes, str | None]]) -> Any:
    """Apply rank 0's recorded calls to this rank's cache; returns the last planned step (or None)."""
    step = None
    for op, failed in ops:
        name, args, kwargs = pickle.loads(op)
        try:
            result = getattr(cache, name)(*args, **kwargs)
        except Exception as e:
            if failed is None:
                raise EngineError(f"tensor-parallel ranks diverged: {name} raised {type(e).__name__} here, "
                                  f"not on rank 0 ({e})") from e
            continue
        if failed is not None:
            raise EngineError(f"tensor-parallel ranks diverged: {name} raised {failed} on rank 0, not here")
        if name == "plan_step":
            step = result
    return step


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class Workers:
    """Ranks 1..N-1 as child processes, each with a pipe pair to rank 0.

    Every message to the workers is the same pickled bytes (a broadcast).
    :meth:`close` stops them (a ``stop`` message, then terminate after a
    grace period) and removes the rendezvous folder; it also runs when the
    object is collected or the interpreter exits.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.store_dir = tempfile.mkdtemp(prefix="kvgen-tp-")
        self.procs: list[subprocess.Popen] = []
        self.to: list[Connection] = []
        self.back: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.to, self.store_dir)

    @property
    def store(self) -> str:
        return os.path.join(self.store_dir, "rendezvous")

    def start(self, spec: RankSpec) -> None:
        """Start ranks 1..N-1 and send them ``spec``; they begin loading at once."""
        env = {**os.environ, **NO_MULTICAST}
        if spec.device_type == "cpu" and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world))  # ranks share the cores
        payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.world):
            down_r, down_w = os.pipe()
            up_r, up_w = os.pipe()
            cmd = [sys.executable, "-m", "kvgen.engine.worker", str(rank), str(down_r), str(up_w)]
            try:
                proc = subprocess.Popen(cmd, env=env, pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL,
                                        stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
            finally:
                os.close(down_r)
                os.close(up_w)
            self.procs.append(proc)
            self.to.append(Connection(down_w, readable=False))
            self.back.append(Connection(up_r, writable=False))
            self.to[-1].send_bytes(payload)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every worker has loaded; EngineError naming the first one that failed."""
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.back, start=1):
            msg = self._reply(rank, conn, deadline)
            if msg != "ready":
                raise EngineError(f"tensor-parallel rank {rank} failed while loading: {msg}")

    def _reply(self, rank: int, conn: Connection, deadline: float) -> Any:
        proc = self.procs[rank - 1]
        while not conn.poll(0.2):
            if proc.poll() is not None and not conn.poll(0):
                raise EngineError(f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                                  f"(its error is printed above)")
            if time.monotonic() > deadline:
                raise EngineError(f"tensor-parallel rank {rank} did not answer in time")
        try:
            return _recv(conn)
        except EOFError:
            proc.wait()
            raise EngineError(f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                              f"(its error is printed above)") from None

    def broadcast(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.to, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                raise EngineError(f"tensor-parallel rank {rank} is gone (exit code "
                                  f"{self.procs[rank - 1].poll()}); its error is printed above") from None

    def gather(self) -> list[Any]:
        """One reply from each worker (after a message that asks for one)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        return [self._reply(rank, conn, deadline) for rank, conn in enumerate(self.back, start=1)]

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of workers that have exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def close(self) -> None:
        """Stop the workers (each finishes its message and exits; stragglers are terminated)."""
        self._finalizer()

    def abort(self) -> None:
        """Terminate the workers now (rank 0 failed while they load or wait in the rendezvous)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        self._finalizer()


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _stop(procs: list[subprocess.Popen], conns: list[Connection], store_dir: str) -> None:
    data = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(data)
            conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()  # only the processes this object started
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    shutil.rmtree(store_dir, ignore_errors=True)  # the folder mkdtemp made for this group


def init_group(spec: RankSpec, rank: int) -> None:
    """Join the ranks' torch.distributed group (the default group of this process)."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    kwargs: dict[str, Any] = {}
    if spec.backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(spec.backend, init_method=f"file://{spec.store}", rank=rank, world_size=spec.world,
                            timeout=datetime.timedelta(minutes=30), **kwargs)


def rank_device(spec: RankSpec, rank: int) -> Any:
    import torch

    if spec.device_type == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def load_cache(spec: RankSpec, rank: int) -> Any:
    """This rank's KVCache: the plan's pages for its KV heads (rank 0 loads its own in the loader, alike)."""
    from kvgen.integrations.transformers import compile_for_model

    package = compile_for_model(spec.plan, spec.kernel_backend)  # rank 0 compiled it already: an import
    kwargs = dict(device=rank_device(spec, rank), max_tokens=spec.max_tokens, autotune=spec.autotune,
                  max_seqs=spec.cache_seqs, tp_rank=rank, tp_size=spec.world, **(spec.host_tier or {}))
    if spec.kernel_choice is None:
        return package.load(**kwargs)
    # An auto package: every rank runs the kernels rank 0 decided (timed on cuda:0 before the workers started),
    # not a choice of its own: a rank deciding alone (its own near-tie timings; no persisted choice where a
    # variant failed on rank 0) could run the other kernel, and then what rank 0 reports and its timing chose
    # would not be what runs (every step waits for the slowest rank). The same auto package with each op's
    # variant pinned, not the package of the decided backend: that one is not compiled (every worker would
    # compile it at once, a CUDA one with nvcc).
    kernels = {op: package.KERNEL_VARIANTS[op][backend] for op, backend in spec.kernel_choice.items()}
    return package.runtime.load(package.PLAN, kernels, **kwargs)


def rank_model(spec: RankSpec, rank: int, cache: Any) -> Any:
    """This rank's CausalLM: the heads its ``cache`` holds, its share of the MLP; weights read as slices."""
    from .shard import TPShard
    from .weights import build_model, load_weights, random_weights

    shard = TPShard.of(spec.cfg, rank, spec.world, cache.q_head_range(), cache.kv_head_range())
    net = build_model(spec.cfg, spec.max_model_len, rank_device(spec, rank), spec.dtype, shard)
    if spec.folder is None:
        random_weights(net, spec.seed)
    else:
        load_weights(net, spec.folder)
    return net


def start_ranks(spec: RankSpec, cache: Any, verbose: bool) -> tuple["TPRunner", RecordingCache]:
    """Rank 0's side of building a tp engine around its loaded ``cache``: start the workers, load, join, capture.

    Returns the runner and the cache the scheduler and engine must use.
    Any failure stops the workers before it propagates.
    """
    import dataclasses

    import torch.distributed as dist

    from .runner import ModelRunner

    workers = Workers(spec.world)
    spec = dataclasses.replace(spec, store=workers.store)
    try:
        workers.start(spec)
        net = rank_model(spec, 0, cache)  # while the workers load theirs
        workers.wait_ready()
        workers.broadcast(("join",))
        init_group(spec, 0)
        graphs = graphs_for(spec, net, cache, verbose)
    except BaseException:
        workers.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    recorder = RecordingCache(cache)
    return TPRunner(ModelRunner(net, cache, graphs), recorder, workers), recorder


def graphs_for(spec: RankSpec, net: Any, cache: Any, verbose: bool) -> Any:
    """Decode graphs of this rank (captured together on every rank: the all-reduces are inside)."""
    if not spec.use_graphs:
        return None
    from .graphs import DecodeGraphs

    return DecodeGraphs(net, cache, spec.max_num_seqs, spec.max_model_len, verbose=verbose)


class TPRunner:
    """Rank 0's runner: sends each step to the workers, then runs its own share (``run`` as ModelRunner's)."""

    device_input_ids = False
    """Token ids come as lists only: they reach the workers pickled from the host (so no async scheduling)."""

    def __init__(self, runner: Any, cache: RecordingCache, workers: Workers) -> None:
        self.runner, self.cache, self.workers = runner, cache, workers
        self.world = workers.world
        self._finalizer = weakref.finalize(self, _shutdown, workers)
        self._eager_next = False

    def __getattr__(self, name: str) -> Any:  # graph_steps, eager_steps, model, graphs, ...
        return getattr(self.runner, name)

    def eager_once(self) -> None:
        """Run the next step eagerly on every rank (see ModelRunner.eager_once)."""
        self._eager_next = True

    def run(self, step: Any, input_ids: list[int], positions: list[int], sample_rows: list[int]) -> Any:
        eager, self._eager_next = self._eager_next, False
        self.workers.broadcast(("step", self.cache.take(), input_ids, positions, step_fingerprint(step), eager))
        if eager:
            self.runner.eager_once()
        try:
            return self.runner.run(step, input_ids, positions, sample_rows)
        except RuntimeError as e:  # a collective failed: name the rank that died, if one did
            dead = self.workers.dead()
            if dead:
                raise EngineError(f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]} "
                                  f"(its error is printed above)") from e
            raise

    def rank_info(self) -> list[dict[str, Any]]:
        """Every rank's :func:`describe` after the pending cache calls (frees) reach it; rank 0 first."""
        self.workers.broadcast(("info", self.cache.take()))
        return [describe(0, self.cache.__wrapped__, self.runner)] + self.workers.gather()

    def close(self) -> None:
        """Stop the workers and leave the process group (also when collected, or at exit); idempotent."""
        self._finalizer()


def _shutdown(workers: Workers) -> None:
    import torch.distributed as dist

    workers.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def describe(rank: int, cache: Any, runner: Any) -> dict[str, Any]:
    """What a rank holds: its heads, its free pages, its sequences, the steps it ran."""
    bm = cache.block_manager
    pools = {"compressed": cache.num_pages, "residual": cache.num_residual_pages}
    if getattr(cache, "host_tier", None) is not None:  # the host tier's pools, counted alike
        cache.wait_host_tier()
        pools.update({p: bm._pool(p).size for p in ("host_compressed", "host_residual")})
    return {"rank": rank, "kv_heads": list(cache.kv_head_range()), "q_heads": list(cache.q_head_range()),
            "num_kv_heads": cache.num_kv_heads, "free_pages": {p: bm.num_free_pages(p) for p, n in pools.items() if n},
            "pages": {p: n for p, n in pools.items() if n}, "sequences": len(cache.sequences()),
            "steps": runner.eager_steps + runner.graph_steps}


def worker_main(rank: int, down: Connection, up: Connection) -> int:
    """A worker's whole life: load, say ready, join the group when told, then replay and run steps until ``stop``."""
    from .runner import ModelRunner

    try:
        spec: RankSpec = _recv(down)
        cache = load_cache(spec, rank)
        net = rank_model(spec, rank, cache)
    except BaseException:
        traceback.print_exc()
        _send(up, f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}")
        return 1
    _send(up, "ready")
    try:  # join the group only when rank 0 says so: if it failed or died meanwhile, exit instead of waiting
        if _recv(down)[0] != "join":
            return 0
    except EOFError:
        return 0
    init_group(spec, rank)
    runner = ModelRunner(net, cache, graphs_for(spec, net, cache, verbose=False))
    import torch.distributed as dist

    try:
        while True:
            try:
                msg = _recv(down)
            except EOFError:  # rank 0 is gone
                return 0
            kind = msg[0]
            if kind == "stop":
                return 0
            step = replay(cache, msg[1])
            if kind == "info":
                _send(up, describe(rank, cache, runner))
                continue
            _, _, ids, pos, check, eager = msg
            if step is None or step_fingerprint(step) != check:
                raise EngineError(f"tensor-parallel rank {rank} planned a different step than rank 0: "
                                  f"{None if step is None else step_fingerprint(step)} != {check}")
            if eager:
                runner.eager_once()
            runner.run(step, ids, pos, [])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
