"""User strings never become code in a generated package (issue 13, item 3).

A model's name comes from a folder name, a config file's stem or, under
``attach``, the config's ``_name_or_path``; it is written into the generated
``__init__.py``. These tests compile packages for hostile names and import
them in a fresh interpreter: the import works and nothing the name says runs.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvgen.codegen.package import compile_plan
from kvgen.codegen.spec import KernelSpec
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.targets import resolve_target

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2, hidden_size=256,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, vocab_size=1000,
              max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)

# Each would run open("PWNED", "w") (or break the import) if pasted into the source unescaped.
CLOSES_DOCSTRING = 'm""";open("PWNED","w");"""'
NEW_LINE = 'm\nopen("PWNED","w")\n#'
BAD_ESCAPE = 'm\\N{x}\\'  # \N{x} is a syntax error in a normal string literal
TRICKY = ['"""', "'''", '\\', '\r\n', '\x00', '\u2028', '\udcff', 'é', '"', "#", "\\u0022"]


def _compile(model: str, out: Path):
    plan = make_plan(resolve_model(model), resolve_target("cpu"), Workload(context=1024, compute_dtype="float32"),
                     default_registry().schemes, kv="fp32")
    compile_plan(plan, out)
    return plan


def _import_all(root: Path, names: list[str], cwd: Path) -> dict[str, str]:
    """Import each package under ``root`` in one fresh interpreter; name -> its docstring, or the error."""
    script = textwrap.dedent(f'''
        import importlib, json, sys
        sys.path.insert(0, {str(root)!r})
        out = {{}}
        for name in {names!r}:
            try:
                out[name] = importlib.import_module(name).__doc__
            except BaseException as exc:
                out[name] = "IMPORT FAILED: " + repr(exc)
        print(json.dumps(out))
    ''')
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hostile_model_names_do_not_run_on_import(tmp_path):
    models, out, cwd = tmp_path / "models", tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    sources = {}
    for i, name in enumerate([CLOSES_DOCSTRING, BAD_ESCAPE]):  # folder names
        folder = models / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(CONFIG))
        sources[f"pkg{i}"] = str(folder)
    stem = models / (NEW_LINE + ".json")  # a config file's stem
    stem.write_text(json.dumps(CONFIG))
    sources["pkg2"] = str(stem)
    plans = {pkg: _compile(src, out / pkg) for pkg, src in sources.items()}
    docs = _import_all(out, sorted(plans), cwd)
    assert not list(cwd.iterdir()), "a model name ran code on import"
    for pkg, plan in plans.items():
        assert not docs[pkg].startswith("IMPORT FAILED"), docs[pkg]
        assert plan.model in docs[pkg]  # the name is kept, as text


def test_hostile_name_or_path_under_attach_does_not_run_on_import(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvgen.integrations.transformers import model_spec

    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    cfg._name_or_path = "/models/" + CLOSES_DOCSTRING
    spec = model_spec(cfg)
    plan = make_plan(spec, resolve_target("cpu"), Workload(context=1024, compute_dtype="float32"),
                     default_registry().schemes, kv="fp32")
    compile_plan(plan, tmp_path / "out" / "pkg")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    docs = _import_all(tmp_path / "out", ["pkg"], cwd)
    assert not list(cwd.iterdir()), "_name_or_path ran code on import"
    assert not docs["pkg"].startswith("IMPORT FAILED") and plan.model in docs["pkg"], docs["pkg"]


@pytest.mark.parametrize("text", TRICKY + [CLOSES_DOCSTRING, NEW_LINE, BAD_ESCAPE, "".join(TRICKY)])
def test_escaped_text_round_trips_as_one_literal(text):
    from kvgen.codegen.pysource import comment, docstring, escape

    assert eval('"' + escape(text) + '"') == text  # noqa: S307 -- the point is what the literal means
    module = ast.parse(docstring("first " + text, "", text + " last") + "\nx = 1\n")
    assert ast.get_docstring(module, clean=False) == f"first {text}\n\n{text} last\n"
    assert len(module.body) == 2
    src = comment(text) + "\nx = 1\n"
    assert len(src.splitlines()) == 2 and len(ast.parse(src).body) == 1


@pytest.mark.parametrize("scheme", ['int8"""', "a b", "x\n", ""])
def test_kernel_spec_refuses_scheme_names_that_are_not_plain(scheme):
    with pytest.raises(ValueError, match="scheme name"):
        KernelSpec(op="decode", scheme=scheme, head_dim=64, num_kv_heads=2, gqa_group=2, page_size=16,
                   compute_dtype="float32", arch="cpu")
