"""Per-token schemes vs float32 attention over the unquantized K/V (issue bounds).

Random normal data, 64 query / 8 KV heads, D=128, 4096 tokens, page 16,
decode (one query per sequence). The KIVI schemes have their own test with
their residual windows (tests/test_kivi_quality.py).
"""

import math

import pytest
import torch

from kvgen.registry import default_registry

BOUNDS = {"int8": 0.010, "fp8": 0.040}


def attention(q, k, v):
    # q [Hq, D]; k, v [Hkv, L, D]; query head h uses KV head h // G
    G = q.shape[0] // k.shape[0]
    s = torch.einsum("hgd,hld->hgl", q.view(k.shape[0], G, -1), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hgl,hld->hgd", s.softmax(-1), v).reshape(q.shape)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_scheme_error_vs_float32(name):
    scheme = default_registry().schemes[name]
    gen = torch.Generator().manual_seed(1)
    errs = []
    for _ in range(2):
        k = torch.randn(8, 4096, 128, generator=gen)
        v = torch.randn(8, 4096, 128, generator=gen)
        q = torch.randn(64, 128, generator=gen)
        # pages of 16 tokens, every head and page quantized independently
        pages = lambda x: x.view(8, 256, 16, 128).transpose(0, 1).reshape(-1, 16, 128)
        kd, vd = scheme.dequantize_page(scheme.quantize_page(pages(k), pages(v)), 128)
        unpage = lambda x: x.view(256, 8, 16, 128).transpose(0, 1).reshape(8, 4096, 128)
        ref = attention(q.double(), k.double(), v.double())
        got = attention(q.double(), unpage(kd).double(), unpage(vd).double())
        errs.append(float((got - ref).norm() / ref.norm()))
    err = max(errs)
    assert 0 < err <= BOUNDS[name], f"{name}: {err:.4f}"
