"""Part a of benchmarks/tp_scaling.py: greedy ``generate()`` through kvgen with tp=1 (one process) against tp=N
(``shard_model`` + ``attach(tp_rank=, tp_size=)``) on N ranks, and its table.

stories260K in float32 is expected token for token; bfloat16 cases (on CUDA: stories260K and a random-weight
Llama at a per-GPU-realistic shape) record the matching tokens and the logits' relative error against tp=1,
since the all-reduce sums partial products in another order. ``equivalence_worker`` is a spawned rank's body
(benchmarks/tp_ranks.py spawns it); rank 0 writes ``opts["equivalence_file"]`` after every case.
"""

from __future__ import annotations

import json
import time
import traceback

import torch

from benchmarks.tp_ranks import barrier, error_text, gather, run_header, setup_rank, write_json

PROMPT = "Once upon a time, there was a little"


def _equiv_cases(opts: dict) -> list[dict]:
    stories = dict(kind="stories", model=opts["model_dir"])
    if opts["device"] == "cpu":
        return [dict(stories, name="stories260K fp32", dtype="float32", scheme="fp32", expect="exact"),
                dict(kind="random", name="random Llama (tiny) fp32", dtype="float32", scheme="fp32", expect="exact",
                     model="random", config=dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                                                 head_dim=32, num_hidden_layers=2, intermediate_size=512,
                                                 vocab_size=256, max_position_embeddings=2048,
                                                 initializer_range=0.05))]
    return [dict(stories, name="stories260K fp32", dtype="float32", scheme="fp32", expect="exact"),
            dict(stories, name="stories260K bf16", dtype="bfloat16", scheme="bf16", expect="record"),
            dict(kind="random", name="random Llama 64/8 D128 h8192 bf16", dtype="bfloat16", scheme="bf16",
                 expect="record", model="random",
                 config=dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                             num_hidden_layers=2, intermediate_size=2048, vocab_size=1024,
                             max_position_embeddings=4096, initializer_range=0.05))]


def _generate_case(case: dict, rank: int, world: int, dev: torch.device, new_tokens: int) -> dict:
    """Greedy tokens and raw logits of one model, sharded for (rank, world), through kvgen."""
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from kvgen.integrations.tensor_parallel import shard_model
    from kvgen.integrations.transformers import attach

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if case["kind"] == "stories":
        tok = AutoTokenizer.from_pretrained(case["model"])
        model = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32).eval()
        ids = tok(PROMPT, return_tensors="pt").input_ids
    else:  # the same seeded float32 init on every rank, then this rank's shard
        model = LlamaForCausalLM(LlamaConfig(**case["config"])).eval()
        ids = torch.randint(3, case["config"]["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
    shard_model(model, rank, world)
    model.to(device=dev, dtype=getattr(torch, case["dtype"]))
    attach(model, scheme=case["scheme"], max_tokens=1024, autotune=False, tp_rank=rank, tp_size=world, device=dev)
    with torch.no_grad():
        # min_new_tokens: an end-of-text token must not cut one run short of the other
        out = model.generate(ids.to(dev), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    logits = torch.stack([step[0].float().cpu() for step in out.logits])
    del model, out
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": tokens, "logits": logits, "seconds": time.perf_counter() - t0}


def _compare(case: dict, ref: dict, per_rank: list[dict], world: int, opts: dict) -> dict:
    rec = dict(case=case["name"], dtype=case["dtype"], scheme=case["scheme"], tp=world, backend=opts["backend"],
               device=opts["device"], expect=case["expect"], new_tokens=opts["new_tokens"])
    errors = {}
    if "error" in ref:
        errors["tp1"] = ref["error"]
    for r, res in enumerate(per_rank):
        if "error" in res:
            errors[f"rank{r}"] = res["error"]
    if errors:
        return dict(rec, errors=errors, exact=False)
    t1, tn = ref["tokens"], per_rank[0]["tokens"]
    matching = next((i for i, (a, b) in enumerate(zip(t1, tn)) if a != b), min(len(t1), len(tn)))
    # Step i's logits come from the same inputs while the first i generated tokens agree.
    steps = min(matching + 1, len(t1), len(tn))
    a, b = per_rank[0]["logits"][:steps].double(), ref["logits"][:steps].double()
    return dict(rec, tokens_tp1=t1, tokens_tpN=tn, ranks_agree=all(r["tokens"] == tn for r in per_rank),
                matching_tokens=matching, exact=t1 == tn and all(r["tokens"] == tn for r in per_rank),
                logits_steps_compared=steps, logits_rel_error=float((a - b).norm() / b.norm()),
                logits_rel_error_first_step=float((a[0] - b[0]).norm() / b[0].norm()),
                logits_max_abs_diff=float((a - b).abs().max()),
                seconds_tp1=ref["seconds"], seconds_tpN=max(r["seconds"] for r in per_rank))


def equivalence_worker(rank: int, world: int, opts: dict) -> None:
    import torch.distributed as dist

    dev = setup_rank(rank, world, opts)
    try:
        doc = dict(run_header(opts, world), records=[]) if rank == 0 else None
        cases = _equiv_cases(opts)
        # tp=1 references, one process each, spread over the ranks (each on its own device).
        mine = {}
        for i, case in enumerate(cases):
            if i % world == rank:
                try:
                    mine[case["name"]] = _generate_case(case, 0, 1, dev, opts["new_tokens"])
                except Exception as exc:
                    traceback.print_exc()
                    mine[case["name"]] = {"error": error_text(exc)}
        refs = {k: v for part in gather(mine) for k, v in part.items()}
        for case in cases:
            try:
                res = _generate_case(case, rank, world, dev, opts["new_tokens"])
            except Exception as exc:  # the same error on every rank keeps the collectives in step
                traceback.print_exc()
                res = {"error": error_text(exc)}
            per_rank = gather(res)
            if rank == 0:
                doc["records"].append(_compare(case, refs[case["name"]], per_rank, world, opts))
                write_json(opts["equivalence_file"], doc)
        barrier(opts, rank)
    finally:
        dist.destroy_process_group()


def equivalence_table(doc: dict) -> str:
    lines = [f"{'case':36} {'tp':>3} {'backend':7} {'tokens equal':>12} {'exact':>6} {'logits rel err':>14}"
             f" {'first step':>10}"]
    for r in doc.get("records", []):
        if r.get("errors"):
            lines.append(f"{r['case']:36} {r['tp']:>3} {r['backend']:7} ERROR {json.dumps(r['errors'])[:200]}")
            continue
        lines.append(f"{r['case']:36} {r['tp']:>3} {r['backend']:7} "
                     f"{str(r['matching_tokens']) + '/' + str(r['new_tokens']):>12} {'yes' if r['exact'] else 'no':>6} "
                     f"{r['logits_rel_error']:>14.2e} {r['logits_rel_error_first_step']:>10.2e}"
                     + ("  (expected exact)" if r["expect"] == "exact" and not r["exact"] else ""))
    if doc.get("error"):
        lines.append(f"part failed: {doc['error']}")
    return "\n".join(lines)
