"""Offline sm_90 SASS of a stripped fp8 decode loop: native e4m3 conversion, with and without the operand swap.

    python -m benchmarks.experiments.fp8_swap_sass

No GPU needed (Triton compiles for sm_90 and cuobjdump lists the SASS). The kernel is a
prototype, not kvgen's: one program, no masks, window or split; it only answers what Triton
makes of (a) e4m3 codes converted with the hardware F2FP unpack instead of bit arithmetic and
(b) the XQA operand swap (64 tokens as the MMA's M, q in fp8) that could put the QK dot on
fp8 tensor cores. Findings in NOTES.md ("fp8: native conversion and the operand swap").
"""
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def swap_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, out_ptr, n_tiles, qscale,
                G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr, SWAP: tl.constexpr,
                FP8: tl.constexpr):
    BN: tl.constexpr = PAGE * PPT
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(q_ptr + offs_g[:, None] * D + offs_d[None, :])
    q8 = (q * qscale).to(tl.float8e4nv)
    m = tl.full([G], -float("inf"), tl.float32)
    l = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    for t in range(n_tiles):
        pages = tl.load(bt_ptr + t * PPT + offs_n // PAGE)
        row = pages.to(tl.int64) * PAGE + offs_n % PAGE
        ks = tl.load(ks_ptr + row)
        if not FP8:  # the baseline: bf16 K/V, as kvgen's bf16 kernel reads them
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :])
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k)) * ks[None, :]
        elif SWAP:
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :]).to(tl.float8e4nv, bitcast=True)
            sT = tl.dot(k, tl.trans(q8))  # [BN, G] on fp8 tensor cores (wgmma M=64)
            s = tl.trans(sT) * ks[None, :]
        else:
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :]).to(tl.float8e4nv, bitcast=True)
            s = tl.dot(q8.to(tl.float16), tl.trans(k.to(tl.float16))) * ks[None, :]
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        vs = tl.load(vs_ptr + row)
        if FP8:
            v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :]).to(tl.float8e4nv, bitcast=True)
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(tl.float16), v.to(tl.float16))
        else:
            v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(tl.bfloat16), v)
        m = m_new
    tl.store(out_ptr + offs_g[:, None] * D + offs_d[None, :], acc / l[:, None])


BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

def stats(kv, swap, ppt, warps, stages):
    kv_type = "*u8" if kv == "fp8" else "*bf16"
    sig = {"q_ptr": "*fp32", "k_ptr": kv_type, "v_ptr": kv_type, "ks_ptr": "*fp32", "vs_ptr": "*fp32", "bt_ptr": "*i32",
           "out_ptr": "*fp32", "n_tiles": "i32", "qscale": "fp32", "G": "constexpr", "D": "constexpr",
           "PAGE": "constexpr", "PPT": "constexpr", "SWAP": "constexpr", "FP8": "constexpr"}
    names = list(sig)
    consts = {"G": 16, "D": 128, "PAGE": 16, "PPT": ppt, "SWAP": swap, "FP8": kv == "fp8"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(swap_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kk = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps, "num_stages": stages})
    f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False); f.write(kk.asm["cubin"]); f.close()
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res).group(1)
    lines = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    best = []
    for addr, ins in lines:
        mt = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        if mt and int(mt.group(1), 16) < addr:
            body = [x for a, x in lines if int(mt.group(1), 16) <= a <= addr]
            if len(body) > len(best):
                best = body
    hist = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in best)
    mma = sorted(set(re.findall(r"\b([HQ]GMMA\.\S+|HMMA\.\S+)", sass)))
    print(f"{kv} swap={swap} ppt={ppt} warps={warps} st={stages} regs {regs} smem {kk.metadata.shared} loop {len(best)} "
          f"({len(best) / (16 * ppt):.1f}/token) " + " ".join(f"{o}:{c}" for o, c in hist.most_common(12)) + f"  mma {mma}", flush=True)



def main():
    for kv, swap in (("bf16", 0), ("fp8", 0), ("fp8", 1)):
        for ppt, warps, st in ((4, 4, 2), (4, 4, 3), (8, 4, 2)):
            stats(kv, swap, ppt, warps, st)


if __name__ == "__main__":
    main()
