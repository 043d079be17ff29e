"""From a model folder or GGUF file (or a config, for random weights) to a running :class:`LLMEngine`.

Plans the KV cache for the model and the device (the detected GPU, or the
``cpu`` target preset on the CPU / under the Triton interpreter), compiles
the plan into the cache directory (a no-op when already compiled), loads the
runtime with the requested capacity, builds the model, loads its weights,
optionally captures decode CUDA graphs, and prints a one-line summary.

``tp=N`` (N > 1) shards the model over N processes, this one being rank 0
(:mod:`kvgen.engine.parallel`); tp=1 starts no process and imports none of it.
A GGUF file (``model="m.gguf"``, or a folder and ``gguf_file=``) gives the
config, tokenizer and dequantized weights (:mod:`kvgen.engine.gguf`).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

from kvgen.planner.workload import COMPUTE_DTYPES

from . import gguf
from .config import DEFAULT_ENGINE_BACKEND, ENGINE_BACKENDS, ModelConfig
from .engine import LLMEngine, async_scheduling_error
from .errors import EngineError
from .runner import ModelRunner
from .weights import build_model, load_weights, random_weights

DTYPES = {**{alias: getattr(torch, name) for alias, name in COMPUTE_DTYPES.items()}, "half": torch.float16}
"""The engine's dtype names: the planner's (``--dtype`` of kvgen plan) plus torch's ``half``."""
CPU_BATCHED_TOKENS = 256
GPU_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256


def resolve_dtype(dtype: Any, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``dtype`` (name or torch dtype); default float32 on the CPU, else the config's (bfloat16 for float32)."""
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        name = cfg.torch_dtype or "bfloat16"
        return torch.bfloat16 if name == "float32" else DTYPES.get(name, torch.bfloat16)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise EngineError(f"dtype {dtype} is not supported; use bfloat16, float16 or float32")
        return dtype
    if dtype not in DTYPES:
        raise EngineError(f"dtype {dtype!r} is not supported; use bfloat16, float16 or float32")
    return DTYPES[dtype]


def _hf_config(folder: Path | None, cfg: ModelConfig, raw: dict[str, Any] | None):
    """A transformers config object for the planner (it reads the model's shape from one)."""
    from transformers import AutoConfig

    if folder is not None:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    conf = AutoConfig.for_model(cfg.model_type, **{k: v for k, v in (raw or {}).items() if k != "model_type"})
    conf._name_or_path = f"random-{cfg.model_type}"
    return conf


def _eos_ids(folder: Path | None, cfg: ModelConfig, tokenizer: Any) -> set[int]:
    """The config's, generation_config.json's (a folder's; None for a GGUF) and the tokenizer's EOS ids."""
    ids = set(cfg.eos_token_ids)
    if folder is not None and (folder / "generation_config.json").is_file():
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def check_kernel_backend(backend: str, device: torch.device) -> str:
    """EngineError unless the engine can run ``backend``'s kernels on ``device``; returns the backend to compile.

    ``auto`` on a non-CUDA device, and on ROCm, is ``triton`` (its CUDA variant could not run there: nothing is
    built with nvcc).
    """
    if backend not in ENGINE_BACKENDS:
        raise EngineError(f"kernel backend must be {', '.join(ENGINE_BACKENDS[:-1])} or {ENGINE_BACKENDS[-1]}, "
                          f"got {backend!r}")
    if device.type == "cuda":
        # ROCm's devices are "cuda" too, but nvcc's kernels cannot run there: auto is Triton, said once here
        # rather than by a skipped variant's warning at every start
        return "triton" if backend == "auto" and getattr(torch.version, "hip", None) else backend
    if backend == "cuda":
        raise EngineError(f"the {backend} kernel backend runs CUDA kernels; the engine is on {device}: use "
                          "--backend auto (kernel_backend='auto', the default) or triton there")
    return "triton"


def decide_decode_kernel(cache: Any, autotune: bool, max_model_len: int, max_num_seqs: int) -> Any:
    """The decode kernel an ``auto`` package's ``cache`` runs from now on, and why (a BackendChoice).

    With ``autotune`` the runtime decides now (``cache.choose_backend``: a
    remembered choice, else the variants timed, and persisted) at the
    engine's two ends of decode: one sequence of ``max_model_len`` tokens,
    and ``max_num_seqs`` sequences sharing the cache's capacity; without,
    the choice the cache made at load stands (the runtime would not time
    them either). Call it before any CUDA graph is captured over
    ``cache.kernels["decode"]``.
    """
    if autotune or "decode" not in cache.backend_choices:  # one decode variant: nothing to time, it says so
        full = max(1, min(max_model_len, cache.capacity_tokens // max_num_seqs))
        return cache.choose_backend("decode", [(1, max_model_len), (max_num_seqs, full)], plan_shapes=False)
    return cache.backend_choices["decode"]


def build_engine(model: str | Path | None = None, *, kv: str = "int8", dtype: Any = None,
                 device: torch.device | str | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, max_tokens: int | None = None,
                 max_num_batched_tokens: int | None = None, page_size: int | None = None, target: str | None = None,
                 enforce_eager: bool = False, config: dict[str, Any] | None = None, seed: int = 0,
                 autotune: bool = True, verbose: bool = True, tp: int = 1, host_tokens: int | str | None = None,
                 staging_tokens: int | None = None, preemption_mode: str | None = None,
                 gguf_file: str | Path | None = None, async_scheduling: bool = False,
                 kernel_backend: str = DEFAULT_ENGINE_BACKEND) -> LLMEngine:
    """An engine for the model folder ``model`` (or, with ``config=`` a config.json dict, random weights).

    ``model`` may also be a ``.gguf`` file, or a folder with ``gguf_file``
    naming the GGUF in it (as transformers' ``gguf_file=``): the config,
    tokenizer and weights (dequantized) come from that file; it needs the
    ``gguf`` package (``pip install 'kvgen[eval]'``).

    ``kv``: the KV-cache scheme (``bf16``, ``int8``, ``int4``, ... with
    options as on the command line). ``max_tokens``: tokens of KV pages
    (default: the plan's capacity on a GPU, ``max_model_len * max_num_seqs``
    (at least 16384) on the CPU). ``max_model_len``: prompt + output limit
    (default: the model's positions, at most the capacity).
    ``max_num_seqs``/``max_num_batched_tokens``: the scheduler's batch
    limits (defaults from the capacity). ``enforce_eager``: no CUDA graphs.
    ``autotune``: the runtime chooses kernel configs per shape bucket on the GPU (persisted winners,
    else its model; ``KVGEN_AUTOTUNE=sync`` times candidates on first use); captured graphs take
    the same choice for their batch bucket.
    ``tp``: tensor-parallel ranks (rank r on cuda:r, NCCL; or gloo processes
    on the CPU); ``engine.close()`` stops them (also at exit).
    ``host_tokens``: tokens of KV pages in a host tier (pinned host memory on
    a GPU; ``"plan"``: the plan's ``host_tier_bytes``), ``staging_tokens``
    its device staging ring (see the runtime's ``load``). ``preemption_mode``:
    ``"swap"`` (default with a host tier: preempted sequences' pages go to the
    host and come back) or ``"recompute"``. ``async_scheduling``: plan
    each steady decode step while the device runs the previous one (a
    one-step lag, as vLLM V1's; see :attr:`LLMEngine.async_scheduling`);
    needs ``tp=1`` and no host tier (EngineError otherwise, before anything loads).
    ``kernel_backend``: the kernels' language, as ``kvgen compile --backend``: ``triton``,
    ``cuda`` (the CUDA decode kernel wherever the scheme's CUDA macros serve the spec: int8, fp8, KIVI int4 and
    int2, 16-bit pages at the head dims they tile; Triton for every other op and spec, said in the summary line
    when verbose) or ``auto`` (default): the package holds both and, before graphs are captured, the runtime decides which
    decode kernel runs by timing them (:func:`decide_decode_kernel`, with ``autotune``; once per GPU and kernel,
    persisted, reused by later starts; the summary says which and why; every tp rank runs rank 0's choice). cuda needs a
    CUDA device (EngineError otherwise, before anything loads); auto off a CUDA device (and on ROCm) is triton,
    and without nvcc (nor a build of the kernel in the build cache) runs Triton after one warning.
    """
    from kvgen.integrations.transformers import compile_for_model, plan_for_model
    from kvgen.runtime import default_device

    folder = None
    gguf_path = hf_conf = None
    if config is None:
        if model is None and gguf_file is None:
            raise EngineError("pass a model folder or .gguf file (or config= for random weights)")
        gguf_path = gguf.resolve(model, gguf_file)
        if gguf_path is not None:
            hf_conf = gguf.hf_config(gguf_path)  # the planner reads the shape from it too
            cfg = ModelConfig.from_dict(hf_conf.to_dict(), str(gguf_path))
        else:
            folder = Path(model).expanduser()
            if not folder.is_dir():
                raise EngineError(f"no model folder at {model}; pass a Hugging Face folder (config.json + "
                                  f"safetensors) or a .gguf file")
            cfg = ModelConfig.from_folder(folder)
    else:
        if gguf_file is not None:
            raise EngineError("gguf_file= names a checkpoint; it does not go with config= (random weights)")
        cfg = ModelConfig.from_dict(config, "config")
    weights_source = gguf_path or folder  # what load_weights reads: a safetensors folder or a GGUF file
    dev = torch.device(device) if device is not None else default_device()
    dev = check_tp(tp, dev)
    kernel_backend = check_kernel_backend(kernel_backend, dev)
    if async_scheduling:  # refused before anything loads (the engine would refuse it after)
        runner_type = ModelRunner
        if tp != 1:
            from .parallel import TPRunner
            runner_type = TPRunner
        err = async_scheduling_error(runner_type, host_tokens is not None)
        if err is not None:
            raise err
    torch_dtype = resolve_dtype(dtype, cfg, dev)
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
        raise EngineError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    limit = cfg.max_position_embeddings if cfg.sliding_window is None else min(cfg.max_position_embeddings,
                                                                               cfg.sliding_window)
    if max_model_len is not None and max_model_len > limit:
        raise EngineError(f"max_model_len {max_model_len} exceeds the model's {limit} positions"
                          f"{' (sliding window)' if cfg.sliding_window else ''}; lower it")
    shim = types.SimpleNamespace(config=hf_conf or _hf_config(folder, cfg, config), dtype=torch_dtype, device=dev)
    plan = plan_for_model(shim, kv, device=dev, target=target, context=max_model_len or limit,
                          concurrency=max_num_seqs or 1, page_size=page_size, tp=tp)
    compile_notes: list[str] = []
    package = compile_for_model(plan, kernel_backend, compile_notes)
    if max_tokens is None:
        if dev.type == "cuda":
            max_tokens = plan.capacity_tokens
        else:
            max_tokens = min(plan.capacity_tokens, max((max_model_len or limit) * (max_num_seqs or 4), 16384))
    autotune = autotune and dev.type == "cuda"
    cache_seqs = max_num_seqs or 4
    tier = host_tier_args(host_tokens, staging_tokens, preemption_mode)
    cache = package.load(device=dev, max_tokens=max_tokens, autotune=autotune, max_seqs=cache_seqs, tp_rank=0,
                         tp_size=tp, **tier)
    capacity = cache.capacity_tokens
    if max_model_len is None:
        max_model_len = min(limit, capacity)
    elif max_model_len > capacity:
        raise EngineError(f"max_model_len {max_model_len} exceeds the cache's {capacity} tokens; "
                          f"lower it or raise max_tokens")
    if max_num_seqs is None:
        max_num_seqs = max(1, min(MAX_NUM_SEQS, capacity // cache.page_size))
    if max_num_batched_tokens is None:
        max_num_batched_tokens = GPU_BATCHED_TOKENS if dev.type == "cuda" else CPU_BATCHED_TOKENS
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise EngineError("max_num_seqs and max_num_batched_tokens must be >= 1")
    # auto: decide the decode kernel now (at the limits just set), before DecodeGraphs capture
    # cache.kernels["decode"] and before the tp ranks load (they run rank 0's choice)
    decode_choice = (decide_decode_kernel(cache, autotune, max_model_len, max_num_seqs)
                     if kernel_backend == "auto" else None)

    tokenizer = gguf.tokenizer(gguf_path) if gguf_path is not None else None
    if folder is not None and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                                     "tokenizer_config.json")):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    use_graphs = dev.type == "cuda" and not enforce_eager
    if verbose:
        print(f"kvgen: {plan.model} kv={plan.scheme} dtype={str(torch_dtype).replace('torch.', '')} "
              f"page={cache.page_size} capacity={capacity} tokens ({capacity // max_model_len} x {max_model_len}-token "
              f"sequences) max_num_seqs={max_num_seqs} max_num_batched_tokens={max_num_batched_tokens} "
              f"device={dev} graphs={'on' if use_graphs else 'off'}{f' tp={tp}' if tp > 1 else ''}"
              f"{_host_summary(cache)}", file=sys.stderr)
        if kernel_backend != "triton":  # say where the CUDA kernels do not serve this plan
            for note in compile_notes:
                # auto without nvcc: the decode choice below says what runs instead (and the runtime warned)
                if note.startswith("decode ") or ("nvcc" in note and kernel_backend == "cuda"):
                    print(f"kvgen: {note}", file=sys.stderr)
        if decode_choice is not None:
            print(f"kvgen: decode kernel: {decode_choice.why}", file=sys.stderr)
    if tp > 1:
        from .parallel import RankSpec, start_ranks

        spec = RankSpec(world=tp, store="", backend="nccl" if dev.type == "cuda" else "gloo", device_type=dev.type,
                        cfg=cfg, plan=plan, folder=None if weights_source is None else str(weights_source), seed=seed,
                        dtype=torch_dtype, max_tokens=max_tokens, cache_seqs=cache_seqs, autotune=autotune,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs, use_graphs=use_graphs,
                        host_tier=tier, kernel_backend=kernel_backend,
                        kernel_choice=dict(cache.kernel_backends) if kernel_backend == "auto" else None)
        runner, cache = start_ranks(spec, cache, verbose)
    else:
        net = build_model(cfg, max_model_len, dev, torch_dtype)
        if weights_source is None:
            random_weights(net, seed)
        else:
            load_weights(net, weights_source)
        graphs = None
        if use_graphs:
            from .graphs import DecodeGraphs
            graphs = DecodeGraphs(net, cache, max_num_seqs, max_model_len, verbose=verbose)
        runner = ModelRunner(net, cache, graphs)
    engine = LLMEngine(runner, cache, tokenizer, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       eos_token_ids=_eos_ids(folder, cfg, tokenizer), vocab_size=cfg.vocab_size,
                       preemption_mode=preemption_mode, async_scheduling=async_scheduling)
    engine.plan = plan
    engine.model_config = cfg
    engine.tp = tp
    return engine


def host_tier_args(host_tokens: Any, staging_tokens: Any, preemption_mode: Any) -> dict[str, Any]:
    """The runtime ``load`` keywords of a host tier (none without one); the engine's own checks first."""
    if host_tokens is None:
        if staging_tokens is not None:
            raise EngineError("staging_tokens needs a host tier; pass host_tokens=N too")
        if preemption_mode == "swap":
            raise EngineError("preemption_mode='swap' needs a host tier; pass host_tokens=N (or 'plan') too")
        return {}
    tier: dict[str, Any] = {"host_tokens": host_tokens}
    if staging_tokens is not None:
        tier["staging_tokens"] = staging_tokens
    return tier


def _host_summary(cache: Any) -> str:
    tier = getattr(cache, "host_tier", None)
    if tier is None:
        return ""
    host = cache.block_manager.num_free_pages("host_compressed") * cache.page_size
    return f" host={host} tokens"


def check_tp(tp: Any, device: torch.device) -> torch.device:
    """Validate ``tp`` for ``device``; returns rank 0's device (cuda:0 for tp > 1 on GPUs)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise EngineError(f"tp must be an int >= 1 (tensor-parallel ranks), got {tp!r}")
    if tp == 1:
        return device
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise EngineError(f"with tp={tp} rank r runs on cuda:r; pass device='cuda' (not {device}) and choose "
                              f"the GPUs with CUDA_VISIBLE_DEVICES")
        if torch.cuda.device_count() < tp:
            raise EngineError(f"tp={tp} needs {tp} GPUs, {torch.cuda.device_count()} are visible; lower tp")
        device = torch.device("cuda", 0)
    elif device.type != "cpu":
        raise EngineError(f"tp > 1 runs on CUDA GPUs (NCCL) or the CPU (gloo), not on {device.type}")
    import torch.distributed as dist

    if not dist.is_available():
        raise EngineError("this torch build lacks torch.distributed; tp > 1 needs it")
    if dist.is_initialized():
        raise EngineError("torch.distributed is already initialized in this process; tp > 1 starts its own "
                          "process group, so build the engine in a process without one (or use tp=1)")
    return device
