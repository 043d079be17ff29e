"""The planner: ModelSpec + Target + Workload + schemes -> Plan.

Each decision (TP shard, page size, scheme, tiering) is a small function
that returns its choice and a one-line reason. Byte counts come from the
memory model in ``kvgen.planner.memory`` (exact fractions, no sympy); the
planner never knows a scheme's layout, it asks the scheme for its bytes per
token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from kvgen.errors import PlanError, SchemeCapabilityError, WorkloadError
from kvgen.models import ModelSpec
from kvgen.planner import memory as mm
from kvgen.planner.host_cost import HostStepCost, host_step_cost
from kvgen.planner.plan import Plan, package_name
from kvgen.planner.workload import Workload
from kvgen.schemes import Scheme, dtype_bytes, resolve_scheme
from kvgen.targets import Target

PAGE_CANDIDATES = (8, 16, 32, 64, 128)
MIN_TILE = 16  # tl.dot needs >= 16 rows: a page smaller than this cannot fill a tensor-core tile alone
COMPUTE_SCHEME = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
GiB = 2**30


@dataclass(frozen=True)
class Shard:
    kv_heads_per_gpu: int
    q_heads_per_gpu: int
    replication: int
    reason: str


def shard_heads(model: ModelSpec, tp: int) -> Shard:
    """Megatron-style: KV heads split across ranks when divisible, replicated when tp > KV heads."""
    hq, hkv = model.num_q_heads, model.num_kv_heads
    if hq % tp:
        raise WorkloadError(
            f"--tp {tp} does not divide {model.name}'s {hq} query heads; use a tp that divides {hq}")
    if tp <= hkv:
        if hkv % tp:
            raise WorkloadError(
                f"--tp {tp} does not divide {model.name}'s {hkv} KV heads; use a divisor of {hkv} or a multiple of it")
        return Shard(hkv // tp, hq // tp, 1,
                     f"tp {tp}: {hkv} KV heads sharded to {hkv // tp} per GPU with their {hq // tp} query heads")
    if tp % hkv:
        raise WorkloadError(
            f"--tp {tp} exceeds {model.name}'s {hkv} KV heads and is not a multiple of them; use a multiple of {hkv}")
    rep = tp // hkv
    return Shard(1, hq // tp, rep,
                 f"tp {tp} > {hkv} KV heads: each KV head replicated on {rep} GPUs (1 KV head and {hq // tp} query heads per GPU)")


def choose_page_size(scheme: Scheme, workload: Workload, head_dim: int) -> tuple[int, str]:
    """Fragmentation at the workload's context vs the kernel tile and the scheme's group."""
    allowed = [p for p in PAGE_CANDIDATES if p in scheme.page_sizes
               and (not scheme.residual_tokens or scheme.residual_tokens % p == 0)]
    if workload.page_size is not None:
        if scheme.residual_tokens and workload.page_size in scheme.page_sizes and scheme.residual_tokens % workload.page_size:
            fits = [p for p in scheme.page_sizes if scheme.residual_tokens % p == 0]
            raise SchemeCapabilityError(
                f"scheme {scheme.label} keeps {scheme.residual_tokens} residual tokens, not a whole number of "
                f"{workload.page_size}-token pages; pass "
                + (f"--page-size {' or '.join(map(str, fits))}, or " if fits else "")
                + "a residual "
                f"that is a multiple of {workload.page_size} (e.g. {scheme.name}:residual="
                f"{-(-scheme.residual_tokens // workload.page_size) * workload.page_size})")
        scheme.check(head_dim, workload.page_size)
        return workload.page_size, f"page {workload.page_size}: set by --page-size"
    if not allowed:
        raise SchemeCapabilityError(f"scheme {scheme.label} supports none of the page sizes {PAGE_CANDIDATES}"
                                    + (f" with {scheme.residual_tokens} residual tokens; use a residual that is a multiple "
                                       f"of {min(scheme.page_sizes)}" if scheme.residual_tokens else ""))
    # Smallest page that fills a tensor-core tile: half a page of waste per
    # sequence on average, and for page-grouped schemes (KIVI keys) the
    # smallest quantization group, hence the lowest error.
    tiled = [p for p in allowed if p >= MIN_TILE]
    page = tiled[0] if tiled else allowed[-1]
    waste = page / 2 / workload.context
    why = (f"page {page}: smallest page >= {MIN_TILE} (one tensor-core tile of tokens) the scheme supports; "
           f"expected tail waste {page // 2} tokens per sequence = {waste:.2%} of a {workload.context}-token context")
    if scheme.residual_tokens is not None:
        why += f"; {scheme.name}'s key quantization group is the page, so smaller pages quantize more finely"
    return page, why


@dataclass(frozen=True)
class Capacity:
    page_size: int
    b_head: Fraction
    kv_per_token: int
    kv_per_token_gpu: int
    residual_per_token_gpu: int
    budget: int
    num_pages: int
    num_residual_pages: int
    capacity_tokens: int
    capacity_sequences: int
    formulas: tuple[str, ...]


def capacity(model: ModelSpec, target: Target, workload: Workload, shard: Shard,
             scheme: Scheme, page: int) -> Capacity:
    """Pages and capacity one GPU gets for ``scheme`` at page size ``page``."""
    b_head = scheme.page_bytes_per_token(model.head_dim, page)
    compute_bytes = dtype_bytes(workload.compute_dtype)
    values = {
        mm.layers: model.num_layers, mm.kv_heads: model.num_kv_heads, mm.kv_heads_gpu: shard.kv_heads_per_gpu,
        mm.bytes_per_head: b_head, mm.params: model.num_params, mm.weight_bits: workload.weight_bits,
        mm.tp: workload.tp, mm.memory: target.memory_bytes, mm.util: mm.exact(workload.gpu_memory_utilization),
        mm.workspace: mm.WORKSPACE_BYTES,
    }
    kv_tok = int(mm.KV_BYTES_PER_TOKEN.value(values))
    kv_tok_gpu = int(mm.KV_BYTES_PER_TOKEN_PER_GPU.value(values))
    residual_tok_gpu = model.num_layers * shard.kv_heads_per_gpu * 2 * model.head_dim * compute_bytes
    budget = math.floor(mm.KV_BUDGET.value(values))
    formulas = [
        mm.show("kv_bytes_per_token", mm.KV_BYTES_PER_TOKEN, values),
        mm.show("kv_bytes_per_token_per_gpu", mm.KV_BYTES_PER_TOKEN_PER_GPU, values),
        mm.show("weight_bytes_per_gpu", mm.WEIGHT_BYTES_PER_GPU, values),
        mm.show("kv_budget_bytes", mm.KV_BUDGET, values),
    ]
    if budget <= 0:
        return Capacity(page, b_head, kv_tok, kv_tok_gpu, residual_tok_gpu, budget, 0, 0, 0, 0, tuple(formulas))
    # Residual schemes keep each live sequence's tail (partial page + R/page full pages)
    # in the compute dtype: reserve that pool for --concurrency sequences first.
    res_pages_per_seq = 0 if scheme.residual_tokens is None else scheme.residual_pages(page) + 1
    num_res = workload.concurrency * res_pages_per_seq
    res_bytes = num_res * page * residual_tok_gpu
    num_pages = max(0, (budget - res_bytes) // (page * kv_tok_gpu))
    if res_bytes > budget:
        num_res = budget // (page * residual_tok_gpu)
    tokens = (num_pages + num_res) * page
    total_pages = -(-workload.context // page)
    comp_per_seq = scheme.compressed_pages(workload.context, page)
    res_per_seq = total_pages - comp_per_seq
    seqs = [num_pages // comp_per_seq] if comp_per_seq else []
    if res_per_seq:
        seqs.append(num_res // res_per_seq)
    formulas.append(
        f"num_pages = floor((kv_budget_bytes - residual_pool_bytes) / (page_size * kv_bytes_per_token_per_gpu))"
        f" = floor(({budget:,} - {res_bytes:,}) / ({page} * {kv_tok_gpu:,})) = {num_pages:,}")
    formulas.append(f"capacity_tokens = (num_pages + num_residual_pages) * page_size = ({num_pages:,} + {num_res:,}) * {page} = {tokens:,}")
    return Capacity(page, b_head, kv_tok, kv_tok_gpu, residual_tok_gpu, budget, num_pages, num_res,
                    tokens, min(seqs) if seqs else 0, tuple(formulas))


def _needed_tokens(workload: Workload) -> int:
    return workload.concurrency * workload.context


def choose_scheme(requested: str, schemes: dict[str, Scheme], model: ModelSpec, target: Target,
                  workload: Workload, shard: Shard) -> tuple[Scheme, int, Capacity, str]:
    """``--kv auto``: the most precise scheme whose capacity meets concurrency x context, else the most compact."""
    if requested != "auto":
        # An unknown name raises kvgen.schemes.unknown_scheme_error, which names a plugin that failed or was left out.
        scheme = resolve_scheme(requested, schemes)
        # The page is chosen first: a residual that only small pages divide (int4:residual=24) is valid.
        page, page_why = choose_page_size(scheme, workload, model.head_dim)
        scheme.check(model.head_dim, page, target.arch_number or None)
        cap = capacity(model, target, workload, shard, scheme, page)
        return scheme, page, cap, f"scheme {scheme.label}: set by --kv; " + page_why
    compute_name = COMPUTE_SCHEME[workload.compute_dtype]
    usable = []
    for s in schemes.values():
        if s.name in COMPUTE_SCHEME.values() and s.name != compute_name:
            continue  # another float format is never better than the compute dtype itself
        try:
            s.check(model.head_dim, _first_page(s), target.arch_number or None)
        except SchemeCapabilityError:
            continue
        usable.append(s)
    if not usable:
        raise PlanError(f"no registered scheme supports head_dim {model.head_dim} on {target.name}; pass --kv explicitly")
    need = _needed_tokens(workload)
    evaluated = []
    for s in sorted(usable, key=lambda s: (s.precision_rank(), s.name)):
        page, page_why = choose_page_size(s, workload, model.head_dim)
        cap = capacity(model, target, workload, shard, s, page)
        evaluated.append((s, page, cap, page_why))
        if cap.capacity_sequences >= workload.concurrency:
            return s, page, cap, (f"scheme {s.name}: the most precise scheme whose capacity "
                                  f"({cap.capacity_sequences:,} sequences of {workload.context}) meets --concurrency "
                                  f"{workload.concurrency}; " + page_why)
    s, page, cap, page_why = min(evaluated, key=lambda e: (e[2].kv_per_token_gpu, e[0].precision_rank()))
    return s, page, cap, (f"scheme {s.name}: no scheme fits {need:,} tokens on the GPU, so the most compact "
                          f"({cap.kv_per_token_gpu:,} B/token/GPU); " + page_why)


def _first_page(scheme: Scheme) -> int:
    return 16 if 16 in scheme.page_sizes else scheme.page_sizes[0]


def choose_tiering(model: ModelSpec, target: Target, workload: Workload,
                   cap: Capacity) -> tuple[str, int, HostStepCost | None, str]:
    """``none`` when the workload fits; ``host`` when it fits with host memory; else refuse.

    Returns (tiering, host tier bytes, the host decode step's cost or None, reason).
    """
    need = _needed_tokens(workload)
    if cap.budget <= 0:
        raise PlanError(
            f"{model.name} weights need {model.num_params * workload.weight_bits // 8 // workload.tp:,} bytes per GPU at "
            f"{workload.weight_bits} bits and tp {workload.tp}, more than {target.name}'s "
            f"{int(target.memory_bytes * workload.gpu_memory_utilization):,} usable bytes minus the "
            f"{mm.WORKSPACE_BYTES:,}-byte workspace; raise --tp or lower --weight-bits")
    if cap.capacity_sequences >= workload.concurrency:
        return "none", 0, None, (f"tiering none: {workload.concurrency} x {workload.context} = {need:,} tokens fit in "
                                f"{cap.capacity_tokens:,} tokens of GPU pages")
    seq_bytes = workload.context * cap.kv_per_token_gpu
    missing_seqs = workload.concurrency - cap.capacity_sequences
    host_bytes = missing_seqs * seq_bytes
    if host_bytes > workload.host_memory_bytes:
        raise PlanError(
            f"{need:,} tokens need {need * cap.kv_per_token_gpu:,} KV bytes per GPU; the GPU holds "
            f"{cap.capacity_tokens:,} tokens and the host tier would need {host_bytes:,} bytes, more than "
            f"--host-memory {workload.host_memory_bytes:,}; lower --concurrency or --context, or pick a smaller --kv")
    # Every decode step reads every live sequence's KV once: what lives on the
    # host must cross the host link each step, overlapped with the attention.
    cost = host_step_cost(cap.capacity_sequences * seq_bytes, host_bytes, target.memory_bandwidth,
                          target.host_link_bandwidth, model.num_layers)
    return "host", host_bytes, cost, (
        f"tiering host: {missing_seqs} of {workload.concurrency} sequences ({host_bytes:,} bytes) do not fit on the GPU; "
        f"streaming them over the {target.host_link_text()} costs {cost.transfer_ms:.2f} ms per decode step vs "
        f"{cost.gpu_ms:.2f} ms to read all KV from device memory; staged one layer ahead of attention, a decode "
        f"step takes about {cost.step_ms:.2f} ms")


def make_plan(model: ModelSpec, target: Target, workload: Workload, schemes: dict[str, Scheme],
              kv: str = "auto") -> Plan:
    """Plan the KV cache of ``model`` on ``target`` for ``workload`` (``kv`` a scheme name or 'auto').

    With ``weight_bits`` None, weights get the most bits (16, 8, 4) whose plan
    serves the workload from GPU memory alone, else the most bits that plan at
    all; an explicit ``weight_bits`` is taken as given (and may be refused).
    """
    if workload.context > model.max_positions:
        # Positions past the trained range are outside what the model (and its RoPE) was built for.
        raise WorkloadError(
            f"--context {workload.context} exceeds {model.name}'s {model.max_positions} positions "
            f"(max_position_embeddings); pass --context {model.max_positions} or less")
    if workload.weight_bits is None:
        return _plan_auto_weight_bits(model, target, workload, schemes, kv)
    return _make_plan(model, target, workload, schemes, kv, weight_reason=f"weights at {workload.weight_bits} bits: set by --weight-bits")


def plan_warnings(plan: Plan) -> list[str]:
    """One line for each thing ``plan`` relies on that kvgen itself does not do (the CLI prints them on stderr).

    kvgen never quantizes weights (a plan with fewer than 16 weight bits
    assumes the user loads a quantized model), and its runtime has no host
    tier yet (a plan with ``tiering == "host"`` assumes sequences are swapped
    to host memory). Such a plan is still valid: these are warnings, not errors.
    """
    out = []
    bits = plan.workload.get("weight_bits")
    if bits is not None and bits < 16:
        out.append(f"plan assumes {bits}-bit weights ({plan.weight_bytes / GiB:.1f} GiB); kvgen does not quantize "
                   f"weights: load a model quantized to {bits} bits, or pass --weight-bits 16 with a larger --tp")
    if plan.tiering == "host":
        fix = (f"lower --concurrency to {plan.capacity_sequences}" if plan.capacity_sequences
               else "lower --context") + " or raise --tp"
        out.append(f"plan needs a host tier ({plan.host_tier_bytes / GiB:.1f} GiB of KV in host memory; GPU pages hold "
                   f"{plan.capacity_sequences} of {plan.concurrency} sequences): load the package with "
                   f"host_tokens='plan' to give the runtime that tier, and expect the host-link cost above per "
                   f"decode step; or {fix}")
    return out


def _plan_auto_weight_bits(model, target, workload, schemes, kv) -> Plan:
    plans, errors = [], []
    for bits in (16, 8, 4):
        w = dataclasses.replace(workload, weight_bits=bits)
        try:
            plans.append(_make_plan(model, target, w, schemes, kv, weight_reason=""))
        except PlanError as exc:
            errors.append(exc)
            continue
        if plans[-1].tiering == "none":
            break
    if not plans:
        raise errors[-1]
    best = next((p for p in plans if p.tiering == "none"), plans[0])
    gib = 2**30
    skipped = [b for b in (16, 8, 4) if b > best.workload["weight_bits"]]
    why = f"weights at {best.workload['weight_bits']} bits ({best.weight_bytes / gib:.1f} GiB): "
    why += ("the most bits whose plan serves the workload from GPU memory" if best.tiering == "none"
            else "the most bits that plan at all (the workload needs a host tier)")
    if skipped:
        why += f"; {'/'.join(map(str, skipped))}-bit weights leave too little room (pass --weight-bits to force)"
    return dataclasses.replace(best, reasons=[*best.reasons, why])


def _make_plan(model: ModelSpec, target: Target, workload: Workload, schemes: dict[str, Scheme],
               kv: str, weight_reason: str) -> Plan:
    shard = shard_heads(model, workload.tp)
    scheme, page, cap, scheme_why = choose_scheme(kv, schemes, model, target, workload, shard)
    tiering, host_bytes, cost, tier_why = choose_tiering(model, target, workload, cap)
    weight_bytes = model.num_params * workload.weight_bits // 8
    name = package_name(model.name, target.name, scheme.name, scheme.option_values, workload.tp, page,
                        workload.compute_dtype)
    return Plan(
        name=name, model=model.name, target=target.name, scheme=scheme.name, scheme_params=scheme.params(),
        scheme_options=dict(scheme.option_values),
        page_size=page, compute_dtype=workload.compute_dtype, tp=workload.tp,
        num_layers=model.num_layers, num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads,
        kv_heads_per_gpu=shard.kv_heads_per_gpu, q_heads_per_gpu=shard.q_heads_per_gpu,
        kv_replication=shard.replication, head_dim=model.head_dim, gqa_group=model.num_q_heads // model.num_kv_heads,
        sliding_window=model.sliding_window or 0, context=workload.context, concurrency=workload.concurrency,
        kv_bytes_per_token=cap.kv_per_token, kv_bytes_per_token_per_gpu=cap.kv_per_token_gpu,
        residual_bytes_per_token_per_gpu=cap.residual_per_token_gpu,
        weight_bytes=weight_bytes, weight_bytes_per_gpu=weight_bytes // workload.tp,
        workspace_bytes=mm.WORKSPACE_BYTES, kv_budget_bytes=cap.budget, num_pages=cap.num_pages,
        num_residual_pages=cap.num_residual_pages, capacity_tokens=cap.capacity_tokens,
        capacity_sequences=cap.capacity_sequences, tiering=tiering, host_tier_bytes=host_bytes,
        host_transfer_ms_per_step=round(cost.transfer_ms, 4) if cost else 0.0,
        host_step_ms=round(cost.step_ms, 4) if cost else 0.0, arch=target.arch,
        page_tensors=[{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
                      for t in scheme.page_tensors(model.head_dim, page)],
        reasons=[r for r in (shard.reason, scheme_why, tier_why, weight_reason) if r],
        formulas=list(cap.formulas),
        model_spec=model.to_json(), target_spec=target.to_json(), workload=workload.to_json(),
    )
