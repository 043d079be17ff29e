"""The q/k/v small GEMM storing k and v straight into the KV cache's pages (write-through, KVWrite).

CPU (CI, Triton interpreter): against the runtime's own cache write kernel (the generated cache_write module,
whose ``PLAIN_TARGET`` / ``PLAIN_ROW_STRIDE`` state the layout the epilogue writes) -- every byte of every pool
tensor the same, q the same, padding rows (negative slots) stored nowhere, page boundaries and every split --
for a plain scheme (fp32 pages) and a residual one (int4: new tokens to its compute-dtype pool). The model with
write-through against the model with the write kernel. GPU: the decode graphs run it (tests/engine/test_gpu.py
compares graph steps with eager ones, which use the write kernel).
"""

from __future__ import annotations

import pytest
import torch

from kvgen.engine import gemv, small_gemm
from kvgen.engine.kv_write import KVWrite
from kvgen.runtime.pools import allocate_pool, poison_
from tests.kernels.harness import load_op, pool_descriptions, residual_descriptions

from .test_small_gemm import interpret  # noqa: F401  (the interpreter-only fixture)

HQ, HKV, D, PAGE = 4, 2, 64, 16


def _tables(d=D):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(256).float(), inv)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


@pytest.mark.parametrize("scheme,dtype,D,PAGE", [("fp32", torch.float32, 64, 16), ("int4", torch.float32, 64, 16),
                                                ("fp16", torch.float16, 96, 8), ("int4", torch.float16, 96, 32)])
def test_write_through_equals_the_cache_write_kernel(interpret, scheme, dtype, D, PAGE):  # noqa: N803
    """(head_dim 96: the write kernel's tile is 128 wide, masked; pages of 8 and 32 tokens)"""
    write = load_op("cache_write", scheme, D, HKV, HQ // HKV, PAGE, dtype, dev="cpu")
    assert write.PLAIN_TARGET == (("rk", "rv") if scheme == "int4" else ("k", "v"))
    from kvgen.registry import default_registry

    s = default_registry().schemes[scheme]
    descs = residual_descriptions(D, PAGE) if scheme == "int4" else pool_descriptions(s, D, PAGE)
    g = torch.Generator().manual_seed(21)
    k_in = 256
    w = torch.randn((HQ + 2 * HKV) * D, k_in, generator=g).to(dtype)
    b = torch.randn((HQ + 2 * HKV) * D, generator=g).to(dtype)
    cos, sin = _tables(D)
    for m in (5, 17, 40):
        x = torch.randn(m, k_in, generator=g).to(dtype)
        pos = torch.randint(0, 256, (m,), generator=g)
        # distinct slots over 6 pages, first and last token of a page among them; two padding rows
        perm = torch.randperm(7 * PAGE, generator=g)
        edge = torch.tensor([PAGE - 1, PAGE])  # the last token of a page and the first of the next
        slots = torch.cat([edge, perm[(perm != PAGE - 1) & (perm != PAGE)]])[:m].to(torch.int64)
        slots[m // 2] = slots[m - 1] = -1
        for cfg in (small_gemm.Config(64, 128, 1), small_gemm.Config(64, 64, 2), small_gemm.Config(32, 64, 4)):
            if (D // 2) % (cfg.block_n // 2):
                continue  # half a column block must divide half a head
            # two copies of a poisoned pool (NaN): what no write reaches stays poison, in both alike
            pools = [{n: poison_(t) for n, t in allocate_pool(descs, 7, HKV, dtype, "cpu").items()}
                     for _ in range(2)]
            ka, va = write.PLAIN_TARGET
            kw = KVWrite(pools[0][ka], pools[0][va], slots, write.PAGE, write.PLAIN_ROW_STRIDE)
            q, none_k, none_v = small_gemm.small_gemm(x, w, b, cfg, rope=small_gemm.Rope(HQ, HKV, D, pos, cos, sin,
                                                                                           kw))
            assert none_k is None and none_v is None
            q_ref, k_ref, v_ref = small_gemm.small_gemm(x, w, b, cfg, rope=small_gemm.Rope(HQ, HKV, D, pos, cos, sin))
            write.launch(k_ref, v_ref, pools[1], slots)
            assert torch.equal(q, q_ref), (m, cfg)
            for name in pools[0]:  # the same bytes, poison (NaN, unequal to itself) included
                assert torch.equal(pools[0][name].view(torch.uint8), pools[1][name].view(torch.uint8)), \
                    (m, cfg, name)
            written = pools[0][ka].view(-1, PAGE, D)
            assert not torch.isnan(written[slots[0] // PAGE * HKV, slots[0] % PAGE]).any()


@pytest.mark.parametrize("scheme,dtype,D,PAGE,qk_norm", [("fp16", torch.float16, 80, 16, False),
                                                          ("int4", torch.float16, 80, 8, True),
                                                          ("fp32", torch.float32, 64, 16, True)])
def test_rope_kernel_write_through_equals_the_cache_write_kernel(interpret, scheme, dtype, D, PAGE,  # noqa: N803
                                                                 qk_norm):
    """The RoPE kernel (the path after the projection; Qwen3's q/k norms) storing k and v into the pages, against
    the projection's rope kernel then the write kernel: the same bytes on poisoned pools, q the same. head_dim 80:
    the kernel's half row is padded to 64 lanes for 40 dims (the slots' offsets must use the real width)."""
    from kvgen.engine import fused
    from kvgen.registry import default_registry

    write = load_op("cache_write", scheme, D, HKV, HQ // HKV, PAGE, dtype, dev="cpu")
    descs = residual_descriptions(D, PAGE) if scheme == "int4" else pool_descriptions(
        default_registry().schemes[scheme], D, PAGE)
    g = torch.Generator().manual_seed(24)
    T = 11
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    pos = torch.randint(0, 256, (T,), generator=g)
    cos, sin = _tables(D)
    norms = ((torch.rand(D, generator=g) + 0.5).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)) \
        if qk_norm else (None, None)
    perm = torch.randperm(5 * PAGE, generator=g)
    edge = torch.tensor([PAGE - 1, PAGE])
    slots = torch.cat([edge, perm[(perm != PAGE - 1) & (perm != PAGE)]])[:T].to(torch.int64)
    slots[4] = -1
    pools = [{n: poison_(t) for n, t in allocate_pool(descs, 6, HKV, dtype, "cpu").items()} for _ in range(2)]
    ka, va = write.PLAIN_TARGET
    kw = KVWrite(pools[0][ka], pools[0][va], slots, write.PAGE, write.PLAIN_ROW_STRIDE)
    q, k, v = fused.qkv_rope(qkv, pos, cos, sin, HQ, HKV, D, *norms, eps=1e-6, write=kw)
    assert k is None and v is None
    q_ref, k_ref, v_ref = fused.qkv_rope(qkv, pos, cos, sin, HQ, HKV, D, *norms, eps=1e-6)
    write.launch(k_ref, v_ref, pools[1], slots)
    assert torch.equal(q, q_ref)
    for name in pools[0]:
        assert torch.equal(pools[0][name].view(torch.uint8), pools[1][name].view(torch.uint8)), name


def test_write_through_refusals(interpret):
    cos, sin = _tables()
    x, w = torch.randn(8, 128), torch.randn((HQ + 2 * HKV) * D, 128)
    pos = torch.zeros(8, dtype=torch.long)
    pool = torch.zeros(4, HKV, PAGE, D)
    cfg = small_gemm.Config(64, 128, 1)
    ok = KVWrite(pool, pool.clone(), torch.zeros(8, dtype=torch.int64), PAGE, PAGE * D)
    assert small_gemm.supports(x, w, None, cfg, rope=small_gemm.Rope(HQ, HKV, D, pos, cos, sin, ok))
    for bad in (KVWrite(pool.half(), pool, ok.slots, PAGE, PAGE * D),  # not x's dtype
                KVWrite(pool, pool, ok.slots.int(), PAGE, PAGE * D),  # int32 slots
                KVWrite(pool, pool, ok.slots[:4], PAGE, PAGE * D),  # not a slot a row
                KVWrite(pool.transpose(2, 3), pool, ok.slots, PAGE, PAGE * D),  # not contiguous
                KVWrite(pool, pool, ok.slots, PAGE, PAGE * D - 1),  # not the pool's row stride
                KVWrite(pool[:, :1], pool[:, :1], ok.slots, PAGE, PAGE * D),  # not HKV heads
                KVWrite(pool.view(4, HKV, 2 * PAGE, D // 2), pool.view(4, HKV, 2 * PAGE, D // 2),
                                   ok.slots, 2 * PAGE, PAGE * D)):  # another page size and head size
        assert not small_gemm.supports(x, w, None, cfg, rope=small_gemm.Rope(HQ, HKV, D, pos, cos, sin, bad)), bad


def test_qkv_rope_linear_writes_through_on_either_kernel(interpret, monkeypatch):
    """Off the small GEMM the RoPE kernel stores k and v into the pages (None back), on it the GEMM's epilogue;
    the torch fallback (``KVGEN_FUSED_TORCH=1``) returns them for the caller's write and leaves the pages alone.
    Both kernels store at the slots what the fallback returns; a padding slot (-1) stores nothing."""
    cos, sin = _tables()
    g = torch.Generator().manual_seed(22)
    x, w = torch.randn(8, 128, generator=g), torch.randn((HQ + 2 * HKV) * D, 128, generator=g)
    pos = torch.randint(0, 256, (8,), generator=g)
    slots = torch.arange(8, dtype=torch.int64) + PAGE - 3  # across a page boundary
    slots[5] = -1

    def target():
        return KVWrite(torch.zeros(4, HKV, PAGE, D), torch.zeros(4, HKV, PAGE, D), slots, PAGE, PAGE * D)

    monkeypatch.setenv("KVGEN_FUSED_TORCH", "1")
    fallback = target()
    q, k, v = gemv.qkv_rope_linear(x, w, None, pos, cos, sin, HQ, HKV, D, write=fallback)
    assert k is not None and v is not None
    assert int(fallback.k.count_nonzero()) == int(fallback.v.count_nonzero()) == 0
    monkeypatch.delenv("KVGEN_FUSED_TORCH")
    want = target()
    for pool, ref in ((want.k, k), (want.v, v)):
        flat = pool.view(-1, PAGE, D)  # rows page * HKV + head
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                flat[(s // PAGE) * HKV:(s // PAGE + 1) * HKV, s % PAGE] = ref[i]
    on_rope_kernel = target()
    q1, k1, v1 = gemv.qkv_rope_linear(x, w, None, pos, cos, sin, HQ, HKV, D, write=on_rope_kernel)
    cfg = small_gemm.Config(64, 128, 1)
    monkeypatch.setattr(gemv, "_chosen", lambda x_, w_, b_: cfg)
    launch = small_gemm.launch_supported
    monkeypatch.setattr(small_gemm, "launch_supported", lambda *a, **kw: launch(*a, interpret=True, **kw))
    on_gemm = target()
    q2, k2, v2 = gemv.qkv_rope_linear(x, w, None, pos, cos, sin, HQ, HKV, D, write=on_gemm)
    assert k1 is v1 is k2 is v2 is None
    torch.testing.assert_close(q1, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q2, q, rtol=1e-5, atol=1e-5)
    for got in (on_rope_kernel, on_gemm):
        torch.testing.assert_close(got.k, want.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.v, want.v, rtol=1e-5, atol=1e-5)


def _tiny_llama(folder):
    """stories260K's tokenizer with a random 2-layer Llama of two 64-dim query heads and one KV head (a head size
    int4 takes, and the RoPE epilogue's half column block of 8 divides half of it), saved as a checkpoint
    folder."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    from .helpers import STORIES

    raw = json.loads((STORIES / "config.json").read_text())
    raw.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=2, intermediate_size=128)
    raw.pop("transformers_version", None)
    cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / name, folder / name)
    return folder


@pytest.mark.parametrize("kv,on_small_gemm", [("fp32", True), ("int4", True), ("int4", False)])
def test_graph_steps_writing_through_give_the_write_kernels_tokens(interpret, kv, on_small_gemm, tmp_path,
                                                                   monkeypatch):
    """The decode graphs' steps (run eagerly on the CPU: static buffers, padding rows, int4's in-graph page
    conversions) with the q/k/v small GEMM's epilogue, or the RoPE kernel after the projection, storing k and v
    into the pages, against the same steps with the cache write kernel: the same greedy tokens, and no write
    kernel in the graph steps."""
    from kvgen.engine import SamplingParams, graphs
    from kvgen.engine.llm import LLM

    folder = _tiny_llama(tmp_path)
    if on_small_gemm:
        cfg = small_gemm.Config(64, 64, 1)  # few programs: the interpreter's time (kernel tests cover the splits)
        monkeypatch.setattr(gemv, "_chosen", lambda x, w, b: cfg if small_gemm.supports(x, w, b, cfg) else None)
        launch = small_gemm.launch_supported
        monkeypatch.setattr(small_gemm, "launch_supported", lambda *a, **kw: launch(*a, interpret=True, **kw))
    # 6 sequences: the graphs' bucket of 8 rows, the small GEMM's (5 to 64)
    prompts = ["Once upon a time there was a", "The sun", "Lily and Tom went to the", "One day", "Tim had a big",
               "She saw a bird and"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results, writes, steps = [], [], []
    for through in (True, False):
        monkeypatch.setattr(graphs, "WRITE_THROUGH", through)
        llm = LLM(str(folder), kv=kv, max_tokens=2048, max_num_seqs=8, verbose=False)
        eng = llm.engine
        write = eng.cache.kernels["cache_write"]
        count = [0]

        def counted(*a, plain=write.launch, **kw):
            count[0] += 1
            return plain(*a, **kw)

        with monkeypatch.context() as m:
            m.setattr(write, "launch", counted)
            eng.runner.graphs = graphs.DecodeGraphs(eng.runner.model, eng.cache, 8, eng.max_model_len,
                                                    capture=False)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        writes.append(count[0])
        steps.append(eng.runner.graph_steps)
        if kv == "int4":
            assert eng.runner.graphs.converted_steps > 0
    assert steps[0] == steps[1] >= 8
    assert results[0] == results[1]
    # every graph step of the write-kernel run wrote each of the 2 layers; the write-through run did not
    assert writes[1] - writes[0] == 2 * steps[1], writes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["bf16", "int4"])
def test_gpu_write_through_at_llama_shapes(scheme):
    """Llama-3-8B's q/k/v (32 + 2 x 8 heads of 128, k 4096) at 32 rows in bfloat16, every candidate tile and
    split whose half column block divides half a head: the pages hold what the runtime's write kernel stores, bit
    for bit, and q is the launch's without the write."""
    from tests.kernels.harness import require_cuda

    require_cuda()
    from kvgen.registry import default_registry

    hq, hkv, d, page, m = 32, 8, 128, 16, 32
    write = load_op("cache_write", scheme, d, hkv, hq // hkv, page, torch.bfloat16, dev="cuda")
    descs = residual_descriptions(d, page) if scheme == "int4" else pool_descriptions(
        default_registry().schemes[scheme], d, page)
    g = torch.Generator(device="cuda").manual_seed(23)
    w = torch.randn((hq + 2 * hkv) * d, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    pos = torch.randint(0, 8192, (m,), device="cuda", generator=g)
    slots = torch.randperm(40 * page, device="cuda", generator=g)[:m]
    slots[3] = -1
    tried = 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in small_gemm.candidates(w.shape[0], w.shape[1], sms):
        if (d // 2) % (cfg.block_n // 2):
            continue
        pools = [{n: poison_(t) for n, t in allocate_pool(descs, 41, hkv, torch.bfloat16, "cuda").items()}
                 for _ in range(2)]
        ka, va = write.PLAIN_TARGET
        kw = KVWrite(pools[0][ka], pools[0][va], slots, write.PAGE, write.PLAIN_ROW_STRIDE)
        try:
            q, _, _ = small_gemm.small_gemm(x, w, None, cfg, rope=small_gemm.Rope(hq, hkv, d, pos, cos, sin, kw))
        except Exception as e:  # a tile whose stages exceed this GPU's shared memory
            if "OutOfResources" not in type(e).__name__:
                raise
            continue
        q_ref, k_ref, v_ref = small_gemm.small_gemm(x, w, None, cfg, rope=small_gemm.Rope(hq, hkv, d, pos, cos, sin))
        write.launch(k_ref, v_ref, pools[1], slots)
        torch.cuda.synchronize()
        assert torch.equal(q, q_ref), cfg
        for name in pools[0]:
            assert torch.equal(pools[0][name].view(torch.uint8), pools[1][name].view(torch.uint8)), (cfg, name)
        tried += 1
    assert tried >= 2
