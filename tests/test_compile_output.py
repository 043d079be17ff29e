"""``kvgen compile --out``: what it may replace, atomic swaps, killed and racing compiles, permissions, bad paths."""

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvgen.cli import main
from kvgen.codegen.package import compile_plan
from kvgen.errors import KvgenError
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.targets import resolve_target

COMPILE = ["compile", "--model", "llama-3-8b", "--target", "h100", "--kv", "int4", "--out"]


@pytest.fixture(scope="module")
def plans():
    schemes = default_registry().schemes
    return {kv: make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(), schemes, kv=kv)
            for kv in ("int4", "int8")}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (and ``root`` itself) -> its bytes (None for a folder)."""
    out = {".": None if root.is_dir() else root.read_bytes()}
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            out[p.relative_to(root).as_posix()] = None if p.is_dir() else p.read_bytes()
    return out


def assert_complete(out: Path) -> dict:
    """``out`` is a package whose manifest matches every file; returns the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest, rel
    return manifest


def refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvgen: error: ") and "\n" not in err and "Traceback" not in err
    return err


# --------------------------------------------------------------------------- what --out may replace


def test_folder_with_other_files_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = snapshot(tmp_path)
    assert "not a kvgen package" in refused(capsys, COMPILE + [str(out)])
    assert snapshot(tmp_path) == before


def test_file_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "pkg"
    out.write_text("a file, not a folder")
    before = snapshot(tmp_path)
    assert "is a file" in refused(capsys, COMPILE + [str(out)])
    assert snapshot(tmp_path) == before


def test_folder_of_packages_is_refused(tmp_path, plans, capsys):
    gen = tmp_path / "generated"
    for plan in plans.values():
        compile_plan(plan, gen / plan.name)
    (gen / "README").write_text("unrelated")
    before = snapshot(tmp_path)
    refused(capsys, COMPILE + [str(gen)])
    assert snapshot(tmp_path) == before


def test_package_with_a_foreign_file_is_refused(tmp_path, plans):
    out = tmp_path / "pkg"
    compile_plan(plans["int8"], out)
    (out / "kernels" / "my_patch.py").write_text("# mine")
    before = snapshot(tmp_path)
    with pytest.raises(KvgenError, match="my_patch.py"):
        compile_plan(plans["int4"], out)
    assert snapshot(tmp_path) == before


def test_symlink_is_refused(tmp_path, plans):
    real = tmp_path / "real"
    compile_plan(plans["int8"], real)
    (tmp_path / "link").symlink_to(real)
    before = snapshot(real)
    with pytest.raises(KvgenError, match="symbolic link"):
        compile_plan(plans["int4"], tmp_path / "link")
    assert snapshot(real) == before


def test_package_and_empty_folder_are_replaced(tmp_path, plans):
    out = tmp_path / "pkg"
    out.mkdir()
    compile_plan(plans["int8"], out)
    assert assert_complete(out)["plan"] == plans["int8"].name
    # Importing writes __pycache__; it does not make the package foreign.
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"")
    compile_plan(plans["int4"], out)
    assert assert_complete(out)["plan"] == plans["int4"].name
    assert sorted(os.listdir(tmp_path)) == ["pkg"]  # no temporary folder or lock file left


def test_permissions_follow_the_umask(tmp_path, plans):
    old = os.umask(0o022)
    try:
        res = compile_plan(plans["int8"], tmp_path / "pkg")
    finally:
        os.umask(old)
    for p in [res.out_dir, *res.out_dir.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


# --------------------------------------------------------------------------- killed and racing compiles

KILLER = textwrap.dedent('''
    import os, sys
    out, when = os.path.abspath(sys.argv[1]), sys.argv[2]
    def wrap(fn):
        # A compile killed just before, or just after, the first operation that touches the package path.
        def wrapped(src, dst, *args, **kwargs):
            touches = out in (os.path.abspath(src), os.path.abspath(dst))
            if touches and when == "before":
                os._exit(9)
            result = fn(src, dst, *args, **kwargs)
            if touches and when == "after":
                os._exit(9)
            return result
        return wrapped
    os.replace, os.rename = wrap(os.replace), wrap(os.rename)
    try:
        import kvgen.atomic
        kvgen.atomic.exchange = wrap(kvgen.atomic.exchange)
    except ImportError:
        pass
    from kvgen.cli import main
    sys.exit(main(["compile", "--model", "llama-3-8b", "--target", "h100", "--kv", "int4", "--out", out]))
''')


@pytest.mark.parametrize("when", ["before", "after"])
def test_killed_compile_leaves_a_package_and_the_next_one_cleans_up(tmp_path, plans, when):
    out = tmp_path / "pkg"
    compile_plan(plans["int8"], out)
    proc = subprocess.run([sys.executable, "-c", KILLER, str(out), when], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    manifest = assert_complete(out)  # the old package or the new one, never none and never a mix
    assert manifest["plan"] in (plans["int8"].name, plans["int4"].name)
    compile_plan(plans["int8"], out)
    assert assert_complete(out)["plan"] == plans["int8"].name
    assert sorted(os.listdir(tmp_path)) == ["pkg"]  # the killed compile's folders and locks are gone


WRITER = textwrap.dedent('''
    import sys, time
    import kvgen.codegen.package as P
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.registry import default_registry
    from kvgen.targets import resolve_target
    out, seconds = sys.argv[1], float(sys.argv[2])
    plans = [make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(), default_registry().schemes, kv=kv)
             for kv in ("int4", "int8")]
    rendered = {p.name: P.render_package(p) for p in plans}
    P.render_package = lambda plan, registry=None: rendered[plan.name]  # swap as fast as the disk allows
    P.compile_plan(plans[1], out)
    print("ready", flush=True)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        P.compile_plan(plans[n % 2], out)
        n += 1
    print(n, flush=True)
''')


def _read_pinned(out: Path) -> str:
    """Read the package through one directory descriptor: 'ok', 'retired' (replaced while read) or what failed."""
    try:
        fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return "missing"

    def read(rel):
        f = os.open(rel, os.O_RDONLY, dir_fd=fd)
        with os.fdopen(f, "rb") as fh:
            return fh.read()
    try:
        manifest = json.loads(read("manifest.json"))
        for rel, digest in manifest["files"].items():
            if hashlib.sha256(read(rel)).hexdigest() != digest:
                return "inconsistent"
        return "ok"
    except (FileNotFoundError, ValueError):
        try:
            same = os.stat(out).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return "missing"
        return "inconsistent" if same else "retired"  # a replaced folder may be deleted under its reader
    finally:
        os.close(fd)


def test_readers_never_see_a_missing_or_mixed_package(tmp_path):
    out = tmp_path / "pkg"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        counts = {"ok": 0, "retired": 0, "missing": 0, "inconsistent": 0}
        manifest = str(out / "manifest.json")
        while writer.poll() is None:
            for _ in range(200):  # cheap checks in between catch short gaps
                if not os.path.exists(manifest):
                    counts["missing"] += 1
            counts[_read_pinned(out)] += 1
        swaps = int(writer.stdout.read().split()[-1])
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0
    assert swaps >= 20 and counts["ok"] >= 20, (swaps, counts)
    assert counts["missing"] == 0 and counts["inconsistent"] == 0, (swaps, counts)
    assert_complete(out)
    assert sorted(os.listdir(tmp_path)) == ["pkg"]


# --------------------------------------------------------------------------- paths kvgen cannot write


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_out_under_proc_fails_at_once():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvgen.cli", *COMPILE, "/proc/kvgen-test-x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgen: error: ") and "/proc" in lines[0]
    assert time.monotonic() - start < 60


def test_read_only_parent_is_one_line(tmp_path, capsys, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # what a read-only file system answers (root ignores chmod)
        if Path(path).parent == parent:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", read_only)
    assert "Read-only file system" in refused(capsys, COMPILE + [str(parent / "pkg")])
    assert os.listdir(parent) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only folder")
def test_unwritable_parent_is_one_line(tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        refused(capsys, COMPILE + [str(parent / "pkg")])
    finally:
        parent.chmod(0o755)


def test_busy_package_is_one_line(tmp_path, plans, monkeypatch):
    import kvgen.atomic

    out = tmp_path / "pkg"
    compile_plan(plans["int8"], out)
    before = snapshot(out)

    def busy(a, b):  # a mount point, or a folder in use on some systems
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(b))
    monkeypatch.setattr(kvgen.atomic, "exchange", busy)
    with pytest.raises(kvgen.atomic.OutputError, match="busy") as exc:
        compile_plan(plans["int4"], out)
    assert "\n" not in str(exc.value)
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["pkg"]


def test_lock_wait_times_out_with_a_clear_error(tmp_path):
    from kvgen.atomic import OutputError, locked, replace_folder

    ready, release = threading.Event(), threading.Event()

    def holder():
        with locked(tmp_path):
            ready.set()
            release.wait(30)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert ready.wait(10)
        start = time.monotonic()
        with pytest.raises(OutputError, match="another kvgen process"):
            replace_folder(tmp_path / "pkg", {"a.txt": "x"}, timeout=0.3)
        assert time.monotonic() - start < 5
        assert not (tmp_path / "pkg").exists()
    finally:
        release.set()
        t.join()
    replace_folder(tmp_path / "pkg", {"a.txt": "x"})
    assert (tmp_path / "pkg" / "a.txt").read_text() == "x"


def test_write_atomic_replaces_whole_files_with_normal_permissions(tmp_path):
    from kvgen.atomic import write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "d" / "f.json", "one")
        write_atomic(tmp_path / "d" / "f.json", b"two")
    finally:
        os.umask(old)
    assert (tmp_path / "d" / "f.json").read_text() == "two"
    assert stat.S_IMODE((tmp_path / "d" / "f.json").stat().st_mode) == 0o644
    assert os.listdir(tmp_path / "d") == ["f.json"]
