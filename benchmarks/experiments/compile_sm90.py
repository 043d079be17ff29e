"""Compile the generated decode kernel for sm_90 offline (no GPU): registers, spills, SASS counts.

    python -m benchmarks.experiments.compile_sm90 int8,ppt=8,warps=4,st=2 int4,ppt=4 ...
Options per case: d, g, page, dtype, ppt, warps, st, direct (1/0), sass (dump file path).
Prints n_regs, n_spills, shared bytes, total SASS instructions, and the instruction mix of the
largest loop body (the block between the last backward branch target and its branch).

The offline compile itself (compile_for_sm90: specialized as the JIT specializes at launch; sass_of:
registers and spills) is shared: prefill_variants --sm90 and the CI's prefill build check
(tests/kernels/sm90_build.py) use it too.
"""
import os, sys, subprocess, tempfile, collections
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("KVGEN_CACHE_DIR", "/tmp/kvgen_sm90_cache")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvgen.codegen.spec import KernelSpec
from kvgen.codegen.loader import load_kernel
from kvgen.registry import default_registry
from benchmarks.experiments.sass_text import instructions, loop_bodies, opcode, resource_usage


def pointer_type(dtype):
    """Triton's signature type of a pointer to ``dtype`` elements (a torch dtype), as the JIT names it."""
    from triton._utils import type_canonicalisation_dict

    return "*" + type_canonicalisation_dict[str(dtype).removeprefix("torch.")]


BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
r = default_registry()


def compile_one(scheme, d=128, g=8, page=16, dtype="bfloat16", ppt=4, warps=4, stages=2, direct=1):
    s = r.schemes[scheme]
    spec = KernelSpec(op="decode", scheme=scheme, head_dim=d, num_kv_heads=8, gqa_group=g, page_size=page,
                      compute_dtype=dtype, arch="sm_90")
    mod = load_kernel(spec, s, r)
    cd = getattr(torch, dtype)
    fn = mod._decode_kernel
    tensors = {t.name: t.torch_dtype(cd) for t in s.page_tensors(d, page)}
    consts = {"DIRECT": bool(direct), "PAGES_PER_TILE": ppt, "BLOCK_N": ppt * page}
    ct = pointer_type(cd)
    pointers = {"q_ptr": ct, "out_ptr": ct, "rk_ptr": ct, "rv_ptr": ct, "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32", **{f"{n}_ptr": pointer_type(t) for n, t in tensors.items()}}
    sig = signature(fn.arg_names, consts, pointers, floats=("qk_scale",))
    # (B=32, L=4096, Hq=64, D=128: q/out strides 8192/128, block-table stride 256)
    return compile_for_sm90(fn, sig, consts, warps, stages)


def signature(names, consts, pointers, floats):
    """A ``sig`` for :func:`compile_for_sm90`: "constexpr" for the keys of ``consts``, ``pointers[name]`` for the
    pointers it names (other ``*_ptr`` arguments: *i32), fp32 for ``floats``, i32 for the rest."""
    def kind(n):
        if n in consts:
            return "constexpr"
        if n.endswith("_ptr"):
            return pointers.get(n, "*i32")
        return "fp32" if n in floats else "i32"
    return {n: kind(n) for n in names}


def compile_for_sm90(fn, sig, consts, num_warps, num_stages, not_divisible=(), ones=(), divisible=()):
    """``triton.compile`` of the jitted ``fn`` for sm_90 with signature ``sig`` (argument -> type, "constexpr" for
    the keys of ``consts``), specialized as the JIT does at launch: pointers 16-byte aligned, ``stride_*``
    arguments divisible by 16, except those in ``not_divisible`` (do_not_specialize), and the integer arguments
    in ``ones`` (1 at launch, e.g. a unit last stride) compiled as the constant 1; other integer arguments named
    in ``divisible`` are divisible by 16 too (as a size the JIT sees so at launch). Without those hints no load
    is vectorized, and register and instruction counts are wrong (NOTES.md)."""
    names = fn.arg_names
    sig, consts = dict(sig), dict(consts)
    for n in ones:
        sig[n], consts[n] = "constexpr", 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in divisible
             or (n.startswith("stride_") and n not in not_divisible and sig[n] != "constexpr")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    # FP fusion as every kvgen launch states it (templates/triton/launch_options.j2)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64),
                          options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True})


PREFILL_COMPUTE_POINTERS = ("q_ptr", "out_ptr", "rk_ptr", "rv_ptr", "kn_ptr", "vn_ptr", "sk_ptr", "sv_ptr")
PREFILL_UNIT_STRIDES = ("stride_qd", "stride_od", "stride_knd", "stride_vnd")
"""The unit last strides of q, out, k_new and v_new: 1 at every launch, so the JIT compiles them as constants."""


def compile_prefill_kernel(fn, page_dtypes, constexprs, num_warps, num_stages, compute=torch.bfloat16):
    """A kernel of a rendered prefill module (``_prefill_kernel``, ``_prefill_staged_kernel``, ``_stage_kernel``)
    compiled for sm_90 as the JIT compiles it on the GPU: compute-dtype q/out/residual/fresh/staging pointers,
    the page tensors' own (``page_dtypes``: tensor name -> torch dtype), the unit strides as constants, the
    block-table stride and ``max_pages`` unspecialized (do_not_specialize)."""
    pointers = {n: pointer_type(compute) for n in PREFILL_COMPUTE_POINTERS}
    pointers.update({f"{n}_ptr": pointer_type(t) for n, t in page_dtypes.items()})
    sig = signature(fn.arg_names, constexprs, pointers, floats=("sm_scale",))
    return compile_for_sm90(fn, sig, constexprs, num_warps, num_stages, not_divisible=("stride_bt", "max_pages"),
                            ones=tuple(n for n in PREFILL_UNIT_STRIDES if n in fn.arg_names))


def sass_of(k):
    """(SASS text, registers, spill bytes) of a compiled Triton kernel (one function in its cubin): cuobjdump
    reports its spills as the STACK frame (LOCAL is other local memory), so both count."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    ob = os.path.join(BIN, "cuobjdump")
    try:
        out = subprocess.run([ob, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([ob, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs, spill = resource_usage(res)
    return out, regs, spill


def loop_sizes(sass):
    """Instruction counts of every loop body, in code order (a kernel with a whole-tile loop and a masked one lists
    both; the largest is not always the one that runs most)."""
    return [len(body) for body in loop_bodies(sass)]


def loop_stats(sass):
    """(instruction count, the largest loop body, that body's opcode histogram)."""
    best = max(loop_bodies(sass), key=len, default=[])
    return len(instructions(sass)), best, collections.Counter(opcode(ins) for ins in best)


def main():
    for arg in sys.argv[1:]:
        parts = arg.split(",")
        scheme = parts[0]
        kw = dict(p.split("=") for p in parts[1:])
        dump = kw.pop("sass", None)
        opts = {k: (v if k == "dtype" else int(v)) for k, v in kw.items()}
        if "st" in opts:
            opts["stages"] = opts.pop("st")
        try:
            k = compile_one(scheme, **opts)
        except Exception as e:
            import traceback; traceback.print_exc()
            print("FAIL", arg, type(e).__name__, str(e)[:1500], flush=True)
            continue
        sass, regs, local = sass_of(k)
        if dump:
            open(dump, "w").write(sass)
            open(dump + ".ptx", "w").write(k.asm["ptx"])
        total, body, hist = loop_stats(sass)
        ppt = opts.get("ppt", 4); page = opts.get("page", 16)
        top = " ".join(f"{o}:{c}" for o, c in hist.most_common(14))
        print(f"{arg:45s} regs {regs:3d} local {local:3d} smem {k.metadata.shared:6d} sass {total:5d} "
              f"loop {len(body):5d} ({len(body) / (ppt * page):.1f}/token)  {top}", flush=True)


if __name__ == "__main__":
    main()
