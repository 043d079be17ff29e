"""``kvgen serve``: an OpenAI-compatible HTTP server on the engine (imports torch/fastapi only when run).

For kvgen/cli.py's COMMANDS table this module offers ``add_args(parser)``
and ``run(args) -> int``. ``python -m
kvgen.serve`` runs it alone. A KvgenError propagates (the CLI prints it as
one line and exits 2); a missing ``serve`` extra is one too.

By default the engine runs in a process of its own (started with
``spawn``; it builds the engine with :func:`kvgen.engine.loader.build_engine`
and this process serves HTTP; see :mod:`kvgen.serve.engine_process`), so
streaming to many clients does not slow the engine's steps through a
shared GIL. ``--engine-in-process`` builds the engine here and runs it on a
thread instead (one process; what ``build_app(engine)`` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvgen.engine.cli import add_speed_args, host_tokens_arg
from kvgen.errors import KvgenError

class ServeError(KvgenError):
    """A bad ``kvgen serve`` setting, or the ``serve`` extra is not installed."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="Hugging Face model folder (config.json, safetensors, tokenizer) or a .gguf file")
    p.add_argument("--kv", default="int8", help="KV-cache scheme, e.g. bf16, int8, int4 (default int8)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in a batch at most")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: one process per GPU (default 1)")
    p.add_argument("--host-tokens", type=host_tokens_arg, default=None,
                   help="KV tokens in a host-memory tier ('plan': the plan's); preempted sequences swap there")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model as given)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the model's; fp32 on the CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit in tokens")
    p.add_argument("--cache-tokens", type=int, default=None, help="KV capacity in tokens (default: the plan's)")
    p.add_argument("--device", default=None, help="torch device (default: the GPU, else the CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_speed_args(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (default: the tokenizer's; for a model without one, "
                        "'<bos>role: content' lines then 'assistant:')")
    p.add_argument("--max-pending", type=int, default=None,
                   help="requests held at most, running and queued; beyond it 429 (default 1024)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take before they are aborted (default 30)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process instead of in a process of its own "
                        "(the default: the HTTP side and the engine then do not share one GIL)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0..65535, got {args.port}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ServeError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_pending is not None and args.max_pending < 1:
        raise ServeError(f"--max-pending must be >= 1, got {args.max_pending}")
    if not args.drain_timeout >= 0:
        raise ServeError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.api_key is not None and not args.api_key:
        raise ServeError("--api-key is empty; give a key or leave the option out")
    if args.chat_template is None:
        return None
    path = Path(args.chat_template)
    if not path.is_file():
        raise ServeError(f"--chat-template {path} is not a file; give a Jinja template file")
    return path.read_text(encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    template = _check(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ServeError(f"kvgen serve needs the serve extra ({e.name} is missing); "
                         f"pip install 'kvgen[serve]'") from None
    from .app import DEFAULT_MAX_PENDING, build_app
    from .server import bind, make_server

    sock = bind(args.host, args.port)  # before loading: a port in use fails in a second, not after the model
    engine_kwargs = dict(model=args.model, kv=args.kv, dtype=args.dtype, max_model_len=args.max_model_len,
                         max_tokens=args.cache_tokens, device=args.device, enforce_eager=args.enforce_eager,
                         max_num_seqs=args.max_num_seqs, tp=args.tp, host_tokens=args.host_tokens,
                         async_scheduling=args.async_scheduling, kernel_backend=args.backend)
    if args.engine_in_process:
        from kvgen.engine.loader import build_engine

        engine = build_engine(**engine_kwargs)
    else:
        from .engine_process import EngineSpec

        engine = EngineSpec("kvgen.engine.loader:build_engine", engine_kwargs)
    try:
        app = build_app(engine, model_name=args.served_model_name or args.model, api_key=args.api_key,
                        max_pending=args.max_pending or DEFAULT_MAX_PENDING, chat_template=template,
                        drain_timeout=args.drain_timeout)
        server = make_server(app, drain_timeout=args.drain_timeout, log_level=args.log_level)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        where = "in this process" if args.engine_in_process else f"process {app.state.serve.worker.pid}"
        print(f"kvgen serve: listening on http://{shown}:{port} (model {app.state.serve.model_name!r}, engine "
              f"{where})", file=sys.stderr, flush=True)
        server.run(sockets=[sock])
    finally:
        if args.engine_in_process:
            engine.close()  # stops tensor-parallel workers at once (a no-op at tp=1); the engine process does its own
    return 0
