"""Plugins can fail or misbehave without breaking kvgen or silently changing what it does (issue 13, item 5).

Third-party plugins are simulated two ways: in-process plugin objects
(``load_registry(extra_plugins=...)``) and real entry points of a fake
distribution written into a temporary folder on ``sys.path``.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from kvgen.cli import main
from kvgen.errors import KvgenError, PluginError
from kvgen.plugin_api import hookimpl
from kvgen.registry import default_registry, load_registry

BUILTINS = ("float", "int8", "fp8", "kivi")
PLAN = ["--model", "llama-3-8b", "--target", "h100"]
_unique = itertools.count()


@pytest.fixture(autouse=True)
def fresh_default_registry():
    """The CLI's process-wide registry must see each test's plugins and environment, and forget them after."""
    default_registry.cache_clear()
    yield
    default_registry.cache_clear()


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """``fake_dist(entry_points={name: source})``: installs a distribution whose kvgen.plugins entry point
    ``name`` is a module with ``source``; returns the distribution's name."""
    def make(entry_points: dict[str, str], dist: str = "evil-plugins") -> str:
        root = tmp_path / f"site{next(_unique)}"
        info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = ["[kvgen.plugins]"]
        for name, source in entry_points.items():
            module = f"kvgen_fake_{name}_{next(_unique)}"
            (root / f"{module}.py").write_text(source)
            lines.append(f"{name} = {module}")
            monkeypatch.delitem(sys.modules, module, raising=False)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(root))
        return dist
    return make


def run_cli(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# -- a plugin that ends the process, or raises on import / in a hook --------------------------------------

EXITS_ON_IMPORT = "raise SystemExit(3)\n"


def test_plugin_raising_systemexit_on_import_is_reported_and_kvgen_goes_on(fake_dist, capsys):
    fake_dist({"aaa_exits": EXITS_ON_IMPORT})
    reg = load_registry()
    record = next(p for p in reg.plugins if p.name == "aaa_exits")
    assert "SystemExit" in record.error
    assert {"fp16", "int8", "int4"} <= set(reg.schemes)

    code, out, err = run_cli(capsys, ["schemes", "--json"])
    assert code == 0 and "int8" in {r["name"] for r in json.loads(out)}
    assert "plugin aaa_exits" in err and "SystemExit" in err  # reported, not silent
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), RuntimeError("boom")])
def test_plugin_hook_raising_any_base_exception_is_recorded(exc):
    class Bad:
        @hookimpl
        def kvgen_register_schemes(self, register):
            raise exc

    reg = load_registry(extra_plugins=(Bad(),))
    assert type(exc).__name__ in reg.plugins[-1].error
    assert "fp16" in reg.schemes


def test_keyboard_interrupt_in_a_plugin_still_interrupts():
    class Interrupted:
        @hookimpl
        def kvgen_register_models(self, register):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_registry(extra_plugins=(Interrupted(),))


# -- name conflicts -------------------------------------------------------------------------------------------

SHADOWS_INT8 = """
from kvgen.plugin_api import hookimpl
from kvgen_plugins.float_schemes import FP32


class Int8(FP32):
    name = "int8"


@hookimpl
def kvgen_register_schemes(register):
    register(Int8())
"""


def test_third_party_plugin_cannot_replace_a_builtin_scheme(fake_dist, capsys):
    # "aaa" sorts before "int8", so the old loader kept its fp32-sized "int8" and recorded nothing visible.
    fake_dist({"aaa": SHADOWS_INT8})
    reg = load_registry()
    with pytest.raises(PluginError) as info:
        reg.schemes
    message = str(info.value)
    assert "aaa (evil-plugins)" in message and "int8 (kvgen)" in message and "'int8'" in message

    code, out, err = run_cli(capsys, ["plan", *PLAN, "--kv", "int8", "--json"])
    assert code == 2 and out == ""
    assert "aaa (evil-plugins)" in err and "int8 (kvgen)" in err and len(err.strip().splitlines()) == 1


def test_two_entry_points_of_one_name_are_an_error(fake_dist):
    fake_dist({"int8": SHADOWS_INT8})
    with pytest.raises(PluginError, match=r"two installed plugins are both named 'int8'") as info:
        load_registry()
    assert "kvgen_plugins.int8 (kvgen)" in str(info.value) and "(evil-plugins)" in str(info.value)


def _registers(kind: str, obj):
    class Plugin:
        pass

    def hook(self, register):
        register(obj)

    setattr(Plugin, f"kvgen_register_{kind}", hookimpl(hook))
    return Plugin


@pytest.mark.parametrize("kind, make", [
    ("targets", lambda: __import__("kvgen.targets", fromlist=["resolve_target"]).resolve_target("h100")),
    ("models", lambda: __import__("kvgen.models", fromlist=["resolve_model"]).resolve_model("llama-3-8b")),
])
def test_two_plugins_registering_one_target_or_model_name_is_an_error(kind, make):
    obj = make()
    first, second = _registers(kind, obj), _registers(kind, obj)
    first.__name__, second.__name__ = "first_plugin", "second_plugin"
    reg = load_registry(extra_plugins=(first(), second()))
    with pytest.raises(PluginError, match=rf"first_plugin and second_plugin both register \w+ '{obj.name}'"):
        getattr(reg, kind)


def test_two_template_folders_with_one_template_name_are_an_error(tmp_path):
    dirs = []
    for i in range(2):
        d = tmp_path / f"macros{i}"
        d.mkdir()
        (d / "mine.j2").write_text(f"{{# version {i} #}}\n")
        dirs.append(d)
    first, second = _registers("templates", dirs[0]), _registers("templates", dirs[1])
    first.__name__, second.__name__ = "first_plugin", "second_plugin"
    reg = load_registry(extra_plugins=(first(), second()))
    with pytest.raises(PluginError, match=r"first_plugin and plugin second_plugin .* both provide template 'mine.j2'"):
        reg.template_dirs


def test_a_template_folder_shadowing_kvgens_own_templates_is_an_error(tmp_path):
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "decode.j2").write_text("evil\n")
    plugin = _registers("templates", tmp_path)
    plugin.__name__ = "shadow"
    with pytest.raises(PluginError, match=r"kvgen's own templates .* and plugin shadow .* 'triton/decode.j2'"):
        load_registry(extra_plugins=(plugin(),)).template_dirs


def test_one_folder_registered_by_several_plugins_is_not_a_conflict():
    reg = load_registry()
    macros = [d for d in reg.template_dirs if d.name == "macros" and (d / "int8.j2").exists()]
    assert len(macros) == 1  # int8, fp8 and kivi each register it; it is searched once


# -- a scheme whose plugin failed, or was left out ---------------------------------------------------------------

def test_scheme_of_a_failed_plugin_is_reported_as_such(fake_dist, capsys):
    fake_dist({"zz8": "import no_such_module_kvgen_test\n"})
    with pytest.raises(KvgenError, match=r"scheme 'zz8' comes from plugin zz8 \(evil-plugins\), which failed to load: "
                                          r"ModuleNotFoundError"):
        load_registry().scheme("zz8")

    code, _, err = run_cli(capsys, ["plan", *PLAN, "--kv", "zz8:x=1"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "comes from plugin zz8" in err and "no_such_module_kvgen_test" in err and "unknown" not in err


def test_unknown_scheme_names_the_plugin_whose_scheme_hook_failed():
    class Broken:
        @hookimpl
        def kvgen_register_schemes(self, register):
            raise ValueError("codebook file unreadable")

    reg = load_registry(extra_plugins=(Broken(),))
    with pytest.raises(KvgenError, match=r"unknown --kv scheme 'nuq9'; plugin Broken failed to load "
                                          r"\(kvgen_register_schemes: ValueError: codebook file unreadable\)"):
        reg.scheme("nuq9")


def test_scheme_of_a_plugin_left_out_by_KVGEN_PLUGINS_says_so(monkeypatch, capsys):
    monkeypatch.setenv("KVGEN_PLUGINS", "float")
    code, _, err = run_cli(capsys, ["plan", *PLAN, "--kv", "int8"])
    assert code == 2
    assert "scheme 'int8' comes from plugin int8, which KVGEN_PLUGINS=float leaves out" in err


# -- built-in plugins are self-contained -------------------------------------------------------------------------------

@pytest.mark.parametrize("plugin", BUILTINS)
def test_each_builtin_plugin_alone_renders_every_kernel_of_its_schemes(monkeypatch, plugin):
    from kvgen.codegen.package import render_package
    from kvgen.models import resolve_model
    from kvgen.planner.planner import make_plan
    from kvgen.planner.workload import Workload
    from kvgen.targets import resolve_target

    monkeypatch.setenv("KVGEN_PLUGINS", plugin)
    reg = load_registry()
    assert reg.schemes and not [p.error for p in reg.plugins if p.error]
    for name in reg.schemes:
        plan = make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), Workload(), reg.schemes, kv=name)
        files = render_package(plan, reg)
        assert any(f.startswith("kernels/") for f in files), name


def test_int8_plugin_alone_compiles_from_the_cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVGEN_PLUGINS", "int8")
    monkeypatch.setenv("KVGEN_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, ["compile", *PLAN, "--kv", "int8", "--out", str(tmp_path / "pkg"), "--json"])
    assert code == 0, err
    assert "kernels/decode.py" in json.loads(out)["files"]
    assert (Path(tmp_path / "pkg") / "plan.json").exists()


# -- KVGEN_PLUGINS typos -----------------------------------------------------------------------------------------------

def test_a_typo_in_KVGEN_PLUGINS_is_a_one_line_error_naming_the_available_plugins(monkeypatch, capsys):
    monkeypatch.setenv("KVGEN_PLUGINS", "int8,kivvi")
    with pytest.raises(PluginError, match=r"KVGEN_PLUGINS names 'kivvi'.*available: .*float.*int8.*kivi"):
        load_registry()
    code, out, err = run_cli(capsys, ["schemes"])
    assert code == 2 and out == ""
    assert err.startswith("kvgen: error: KVGEN_PLUGINS names 'kivvi'") and len(err.strip().splitlines()) == 1


# -- a scheme whose macros follow an older contract ------------------------------------------------------------

def test_macros_written_for_the_old_store_tokens_contract_fail_with_the_scheme_named(tmp_path):
    """store_tokens took one token (6 arguments) before it took a tile (7): such a plugin's cache write must
    fail with a PluginError naming the scheme and the guide, not with a Jinja traceback."""
    from kvgen.codegen.render import render_kernel
    from kvgen.codegen.spec import KernelSpec
    from kvgen_plugins.float_schemes import FP16

    float_macros = (Path(__file__).parents[1] / "templates" / "triton" / "schemes" / "float.j2").read_text()
    start = float_macros.index("{% macro store_tokens(")
    end = float_macros.index("{% endmacro %}", start) + len("{% endmacro %}")
    old = ("{% macro store_tokens(k, v, base, slot, offs_d, L) %}\n"
           "tl.store({{ L.t.k.ptr }} + {{ base }} * {{ L.t.k.stride }} + {{ slot }} * {{ L.head_dim }} + {{ offs_d }}, "
           "{{ k }})\n{% endmacro %}")
    (tmp_path / "oldmacros").mkdir()
    (tmp_path / "oldmacros" / "old16.j2").write_text(float_macros[:start] + old + float_macros[end:])

    class Old16(FP16):
        name = "old16"
        macro_template = "oldmacros/old16.j2"

    schemes, templates = _registers("schemes", Old16()), _registers("templates", tmp_path)
    reg = load_registry(extra_plugins=(schemes(), templates()))
    spec = KernelSpec(op="cache_write", scheme="old16", head_dim=64, num_kv_heads=2, gqa_group=2, page_size=16,
                      compute_dtype="float16", arch="sm_90")
    with pytest.raises(PluginError, match=r"cache_write kernel of scheme 'old16' \(macros oldmacros/old16.j2\) "
                                          r"failed: TypeError: .*store_tokens.*plugin-guide.md"):
        render_kernel(spec, reg.schemes["old16"], reg)
    # its decode still renders: only the changed macro's callers fail
    assert "def launch" in render_kernel(KernelSpec(op="decode", scheme="old16", head_dim=64, num_kv_heads=2,
                                                    gqa_group=2, page_size=16, compute_dtype="float16", arch="sm_90"),
                                         reg.schemes["old16"], reg)
