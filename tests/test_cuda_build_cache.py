"""The CUDA build cache, with a stand-in nvcc that counts its runs: keyed by source, arch and compiler version,
written atomically under one lock shared by the compiler and the loader, and a failed build leaves nothing.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from kvgen.codegen.cuda_build import build_arch, build_package, build_source
from kvgen.runtime import cuda_loader


FAKE_NVCC = """#!/bin/sh
# a stand-in nvcc: --version, or "build" by copying the source into -o's file, counting runs
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V{version}"; exit 0; fi
echo run >> "{count}"
out=""; src=""
while [ $# -gt 0 ]; do case "$1" in -o) out="$2"; shift;; *.cu) src="$1";; esac; shift; done
if grep -q FAIL "$src"; then echo "kernel.cu(3): error: broken template" >&2; exit 1; fi
sleep 0.3
cat "$src" > "$out"
"""


def _fake_nvcc(tmp_path: Path, version: str = "13.0.88") -> tuple[str, Path]:
    count = tmp_path / f"runs-{version}"
    nvcc = tmp_path / f"nvcc-{version}"
    nvcc.write_text(FAKE_NVCC.format(version=version, count=count))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return str(nvcc), count


def _runs(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_build_cache_key_covers_source_arch_and_nvcc_version(tmp_path):
    nvcc, count = _fake_nvcc(tmp_path)
    root = tmp_path / "cache"
    a = cuda_loader.build("// a\n", "sm_90a", root=root, nvcc=nvcc)
    assert a.read_text() == "// a\n" and _runs(count) == 1
    assert cuda_loader.build("// a\n", "sm_90a", root=root, nvcc=nvcc) == a and _runs(count) == 1  # cached
    b = cuda_loader.build("// b\n", "sm_90a", root=root, nvcc=nvcc)
    c = cuda_loader.build("// a\n", "sm_80", root=root, nvcc=nvcc)
    nvcc2, count2 = _fake_nvcc(tmp_path, "13.1.10")
    d = cuda_loader.build("// a\n", "sm_90a", root=root, nvcc=nvcc2)
    assert len({a, b, c, d}) == 4 and _runs(count) == 3 and _runs(count2) == 1
    assert "sm_80" in c.name and "nvcc13.1.10" in d.name
    assert cuda_loader.find_built("// a\n", "sm_90a", root=root) in (a, d)  # loading without nvcc
    assert cuda_loader.find_built("// zzz\n", "sm_90a", root=root) is None
    with pytest.raises(cuda_loader.CudaBuildError, match="arch"):
        cuda_loader.build("// a\n", "sm_90a/../../x", root=root, nvcc=nvcc)


def test_concurrent_builders_run_nvcc_once_and_see_whole_libraries(tmp_path):
    nvcc, count = _fake_nvcc(tmp_path)
    root = tmp_path / "cache"
    source = "// racing\n" * 1000
    results, errors = [], []

    def builder():
        try:
            results.append(cuda_loader.build(source, "sm_90a", root=root, nvcc=nvcc))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and _runs(count) == 1
    assert results[0].read_text() == source
    assert sorted(p.name for p in (root / "cuda").iterdir()) == [results[0].name]


def test_failed_build_raises_and_leaves_nothing(tmp_path):
    nvcc, _ = _fake_nvcc(tmp_path)
    root = tmp_path / "cache"
    with pytest.raises(cuda_loader.CudaBuildError, match="broken template"):
        cuda_loader.build("// FAIL\n", "sm_90a", root=root, nvcc=nvcc)
    assert list((root / "cuda").iterdir()) == []


def test_compiler_side_build_is_the_library_the_loader_looks_up(tmp_path, monkeypatch):
    nvcc, count = _fake_nvcc(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvcc").symlink_to(nvcc)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert build_arch("sm_90") == "sm_90a" and build_arch("sm_89") == "sm_89" and build_arch("cpu") is None
    lib = build_source("// x\n", "sm_90a")
    assert lib == cuda_loader.library_path("// x\n", "sm_90a", "13.0.88")
    report = build_package({"kernels/decode.cu": "// y\n", "kernels/decode.py": "# z\n"}, "sm_90")
    assert list(report.libraries) == ["kernels/decode.cu"] and report.skipped is None and _runs(count) == 2
    assert "not a CUDA arch" in build_package({"kernels/decode.cu": "// y\n"}, "cpu").skipped


def test_compiler_and_loader_take_one_lock_and_write_libraries_alike(tmp_path):
    from kvgen.atomic import locked

    nvcc, _ = _fake_nvcc(tmp_path)
    old = os.umask(0o022)
    try:
        loaded = cuda_loader.build("// l\n", "sm_90a", root=tmp_path / "cache", nvcc=nvcc)
        compiled = cuda_loader.build("// c\n", "sm_90a", root=tmp_path / "cache", nvcc=nvcc, locked=locked)
    finally:
        os.umask(old)
    assert stat.S_IMODE(loaded.stat().st_mode) == stat.S_IMODE(compiled.stat().st_mode) == 0o755
    folder = tmp_path / "cache" / "cuda"
    with locked(folder):  # kvgen compile holds the folder: a loading application waits for it
        with pytest.raises(cuda_loader.CudaBuildError, match="another process has been building"):
            with cuda_loader._locked(folder, timeout=0.2):
                pass


