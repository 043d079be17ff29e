"""Codebook fitting (1-D k-means), key normalization and the codebook file."""

from __future__ import annotations

import json

import pytest
import torch

from kvgen_nuq.codebook import (CodebookError, check_codebook, fit_codebook, level_midpoints, load_codebooks, midpoints,
                                normalized_inliers, rms_error, save_codebooks)


def test_fit_recovers_known_centers():
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([-0.97, -0.8, -0.66, -0.55, -0.41, -0.3, -0.2, -0.09,
                            0.02, 0.15, 0.29, 0.38, 0.52, 0.68, 0.83, 0.99])
    sizes = torch.randint(2_000, 12_000, (16,), generator=g)     # unequal clusters
    x = torch.cat([c + 0.004 * torch.randn(int(n), generator=g) for c, n in zip(centers, sizes)])
    x = x[torch.randperm(x.numel(), generator=g)]
    cb, mse = fit_codebook(x)
    assert cb.dtype == torch.float32 and cb.shape == (16,)
    assert (cb[1:] > cb[:-1]).all()
    assert torch.allclose(cb, centers, atol=2e-3), (cb - centers).abs().max()
    assert mse < 2e-5


def test_fit_gaussian_is_non_uniform_and_beats_uniform():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g)
    cb, mse = fit_codebook(x)
    gaps = cb[1:] - cb[:-1]
    assert gaps[7] < gaps[0] and gaps[7] < gaps[-1]          # dense in the middle
    # Lloyd-Max for a unit Gaussian at 16 levels has MSE ~0.0095.
    assert 0.008 < mse < 0.011
    uniform = torch.linspace(float(cb[0]), float(cb[-1]), 16)
    assert rms_error(x, cb) < rms_error(x, uniform)


def test_fit_with_few_distinct_values_stays_strictly_ascending():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0] * 100 + [float(i) for i in range(20)])
    cb, _ = fit_codebook(x)
    assert (cb[1:] > cb[:-1]).all() and torch.isfinite(cb).all()
    with pytest.raises(CodebookError):
        fit_codebook(torch.zeros(5))


def test_normalized_inliers_in_unit_range_and_skip_outliers():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(2, 64, 32, generator=g)
    k[:, :, 3] += 100.0          # every token's outlier: excluded, channel has no inlier... almost
    x, w = normalized_inliers(k, page_size=16)
    assert x.numel() == w.numel() == 2 * 4 * 16 * 31           # one outlier per token removed
    assert x.abs().max() <= 1.0 + 2e-3                          # float16 rounding of scale/zero
    assert x.abs().max() > 0.99                                 # every channel's min and max land on +-1
    assert (w > 0).all() and w.max() < 25                       # squared half ranges of N(0, 1) channels
    assert normalized_inliers(k[:, :10], page_size=16)[0].numel() == 0


def test_weights_keep_near_constant_channels_from_pulling_levels():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(100_000, generator=g) * 2 - 1
    far = torch.full((2_000,), -26.0)                          # float16-zero artefacts of tiny channels
    xs = torch.cat([x, far])
    plain, _ = fit_codebook(xs)
    weighted, _ = fit_codebook(xs, torch.cat([torch.ones_like(x), torch.full_like(far, 1e-8)]))
    assert plain[0] < -20 and weighted[0] > -1.01


def test_codebook_file_roundtrip(tmp_path):
    cb = torch.linspace(-1, 1, 16) ** 3
    fits = {16: {"pooled": cb, "layers": [cb, cb * 0.9], "stats": [{"layer": 0}]},
            64: {"pooled": cb * 0.8, "layers": []}}
    path = tmp_path / "cb.json"
    save_codebooks(path, fits, {"model": "m", "keys": "post-rope"})
    data = load_codebooks(path)
    assert data["model"] == "m" and sorted(data["codebooks"]) == [16, 64]
    # float32 values written exactly; read back as tuples of floats (no torch needed to load a codebook)
    assert isinstance(data["codebooks"][16]["pooled"], tuple)
    assert data["codebooks"][16]["pooled"] == tuple(cb.tolist())
    assert data["codebooks"][16]["layers"][1] == tuple((cb * 0.9).float().tolist())
    assert data["codebooks"][64]["pooled"] == tuple((cb * 0.8).float().tolist())


@pytest.mark.parametrize("content", [
    "not json",
    json.dumps({"format": "other"}),
    json.dumps({"format": "kvgen-nuq-codebook/1", "codebooks": {}}),
    json.dumps({"format": "kvgen-nuq-codebook/1", "codebooks": {"16": {"pooled": [0.0] * 16}}}),
    json.dumps({"format": "kvgen-nuq-codebook/1", "codebooks": {"16": {"pooled": list(range(15))}}}),
    json.dumps({"format": "kvgen-nuq-codebook/1", "codebooks": {"x": {"pooled": list(range(16))}}}),
])
def test_bad_codebook_files(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(CodebookError, match="kvgen nuq calibrate"):
        load_codebooks(path)
    with pytest.raises(CodebookError):
        load_codebooks(tmp_path / "missing.json")


def test_check_codebook():
    assert check_codebook(range(16)) == tuple(float(i) for i in range(16))
    # levels are rounded to float32, as the kernels (and torch.tensor(..., float32)) hold them
    levels = [i / 10 - 0.75 for i in range(16)]
    assert check_codebook(levels) == tuple(torch.tensor(levels, dtype=torch.float32).tolist())
    assert check_codebook(torch.linspace(-1, 1, 16)) == tuple(torch.linspace(-1, 1, 16).tolist())
    for bad in ([1.0] * 16, [float("nan")] + list(range(15)), ["a"] * 16, list(range(15)), 3,
                [-1e39] + list(range(15)),                                   # -inf once stored as float32
                [0.0, 1e-46] + list(range(2, 16)),                           # 1e-46 is float32 0.0: not ascending
                [[0.0]] + list(range(1, 16))):
        with pytest.raises(CodebookError):
            check_codebook(bad)


@pytest.mark.parametrize("name", ["stories260K", "smollm2-135m"])
def test_thresholds_without_torch_equal_torch_midpoints(name):
    # The kernels bake in level_midpoints (plain Python, so compiling needs no torch); the torch reference
    # encodes with midpoints: codes match only if both give the same float32 values, bit for bit.
    from kvgen_nuq.scheme import read_codebooks

    books, _ = read_codebooks(name)
    rng = torch.Generator().manual_seed(0)
    random = [tuple(torch.sort(torch.randn(16, generator=rng) * 10.0 ** e).values.tolist()) for e in range(-40, 38, 6)]
    for levels in [*books.values(), *random]:
        levels = check_codebook(levels)
        assert level_midpoints(levels) == tuple(midpoints(torch.tensor(levels)).tolist()), levels
