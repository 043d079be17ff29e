"""The autotuner's timer (kvgen.runtime.kernel_timer) on a GPU: GPU time, not launch time."""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime.kernel_timer import do_bench_ms, graph_time_ms


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
def test_graph_time_of_a_bandwidth_bound_kernel_matches_its_bytes():
    """A 1 GiB in-place scale moves 2 GiB: its graph time and do_bench's agree within 15% (both GPU-bound)."""
    _cuda()
    x = torch.randn(2**28, device="cuda")  # 1 GiB of fp32
    g = graph_time_ms(lambda: x.mul_(1.0000001))
    d = do_bench_ms(lambda: x.mul_(1.0000001))
    assert 0.85 < g / d < 1.15, (g, d)
    assert 2 * x.numel() * 4 / (g * 1e-3) < 6e12  # no faster than an H200's memory could be


@pytest.mark.gpu
def test_graph_time_of_a_tiny_kernel_is_below_its_launch():
    """A one-element add runs in a few microseconds; do_bench times its launch, graph time does not."""
    _cuda()
    x = torch.zeros(1, device="cuda")

    def many_small_launches():  # a launch that costs far more host time than GPU time
        for _ in range(20):
            x.add_(1.0)
    g = graph_time_ms(many_small_launches)
    d = do_bench_ms(many_small_launches)
    assert g < d, (g, d)
    before = x.item()
    many_small_launches()
    assert x.item() == before + 20  # the stream still works after the capture


@pytest.mark.gpu
def test_a_call_that_cannot_be_captured_is_timed_the_old_way():
    """A host synchronization inside fn breaks capture: the timer falls back to do_bench and CUDA stays usable."""
    _cuda()
    x = torch.ones(1024, device="cuda")
    before = torch.cuda.current_stream()
    ms = graph_time_ms(lambda: x.sum().item())
    assert 0 < ms < 100
    assert torch.cuda.current_stream() == before  # the failed capture's stream is not left current
    assert torch.cuda.is_available() and x.sum().item() == 1024.0
