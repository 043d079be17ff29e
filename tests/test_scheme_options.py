"""Per-scheme options: ``NAME:key=value`` parsing, the ``with_options`` contract, and KIVI's ``residual``."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from kvgen.cli import main
from kvgen.codegen.package import kernel_specs, plan_scheme, render_package
from kvgen.errors import KvgenError, PlanError, SchemeOptionError, UnknownSchemeError
from kvgen.models import resolve_model
from kvgen.planner.planner import make_plan
from kvgen.planner.workload import Workload
from kvgen.registry import default_registry
from kvgen.schemes import Scheme, parse_scheme_spec, resolve_scheme
from kvgen.targets import resolve_target


@pytest.mark.parametrize("text, expect", [
    ("int4", ("int4", {})),
    (" int4 ", ("int4", {})),
    ("nuq4:codebook=x", ("nuq4", {"codebook": "x"})),
    ("nuq4:codebook=/tmp/a b/c.json", ("nuq4", {"codebook": "/tmp/a b/c.json"})),
    ("s:a=1:b=two", ("s", {"a": "1", "b": "two"})),
    ("s:a=x=y", ("s", {"a": "x=y"})),          # a value runs to the next ':'
    ("s:a=", ("s", {"a": ""})),
])
def test_parse_scheme_spec(text, expect):
    assert parse_scheme_spec(text) == expect


@pytest.mark.parametrize("text, expect", [
    ("", "no scheme name"),
    (":a=1", "no scheme name"),
    ("nuq4:codebook", "bad option 'codebook'"),
    ("nuq4:", "bad option ''"),
    ("nuq4:=x", "bad option '=x'"),
    ("nuq4:a b=1", "bad option"),
    ("s:a=1:a=2", "given twice"),
])
def test_parse_scheme_spec_rejects_bad_syntax(text, expect):
    with pytest.raises(SchemeOptionError, match=expect) as info:
        parse_scheme_spec(text)
    assert isinstance(info.value, KvgenError) and "\n" not in str(info.value)


class Toy(Scheme):
    """A scheme with one option, to check the base class's side of the contract."""

    name = "toy"
    bits = 8
    options = {"knob": "an integer", "other": "a string"}
    knob = 1

    def configure(self, knob: str = "1", other: str = "") -> "Toy":
        new = copy.copy(self)
        new.knob = int(knob)
        return new


class Lazy(Toy):
    def configure(self, **values):
        return self           # breaks the contract: must return a new instance


def test_with_options_returns_a_new_configured_instance():
    toy = Toy()
    a = toy.with_options(knob=3)
    assert a is not toy and a.knob == 3 and a.option_values == {"knob": "3"}
    assert toy.knob == 1 and toy.option_values == {} and "options" not in toy.params()
    assert a.name == "toy" and a.label == "toy:knob=3" and a.params()["options"] == {"knob": "3"}
    b = a.with_options(other="x")                   # chained: merged over the options a already has
    assert b.knob == 3 and b.option_values == {"knob": "3", "other": "x"} and b.label == "toy:knob=3:other=x"
    assert a.option_values == {"knob": "3"}
    assert toy.with_options() is toy
    with pytest.raises(SchemeOptionError, match="scheme toy has no option 'nope'; its options are knob, other"):
        toy.with_options(nope=1)
    with pytest.raises(TypeError, match="must return a new"):
        Lazy().with_options(knob=2)


def test_resolver_against_the_registry():
    schemes = default_registry().schemes
    assert resolve_scheme("int8", schemes) is schemes["int8"]
    with pytest.raises(UnknownSchemeError, match="'int3'"):
        resolve_scheme("int3:residual=16", schemes)
    with pytest.raises(SchemeOptionError, match="scheme int8 has no option 'group'; it takes no options"):
        resolve_scheme("int8:group=64", schemes)
    with pytest.raises(SchemeOptionError, match="its options are residual"):
        resolve_scheme("int4:group=64", schemes)
    with pytest.raises(SchemeOptionError, match="residual must be a whole number"):
        resolve_scheme("int4:residual=-16", schemes)
    assert default_registry().scheme("int4:residual=32").residual_tokens == 32


def test_with_options_never_mutates_registered_schemes():
    reg = default_registry()
    before = {n: (dict(vars(s)), s.params()) for n, s in reg.schemes.items()}
    for text in ("int4:residual=64", "int2:residual=32", "int2:residual=0"):
        configured = reg.scheme(text)
        assert configured is not reg.schemes[configured.name]
    assert {n: (dict(vars(s)), s.params()) for n, s in reg.schemes.items()} == before
    assert reg.schemes["int4"].residual_tokens == 0 and reg.schemes["int2"].residual_tokens == 128


def _plan(kv: str, **workload):
    w = Workload(**{"context": 4096, "concurrency": 64, "weight_bits": 16, **workload})
    return make_plan(resolve_model("llama-3-8b"), resolve_target("h100"), w, default_registry().schemes, kv=kv)


def test_kivi_residual_option_changes_the_plan():
    base, r64 = _plan("int4"), _plan("int4:residual=64")
    assert base.scheme == r64.scheme == "int4"
    assert base.scheme_options == {} and r64.scheme_options == {"residual": "64"}
    assert base.scheme_params["residual_tokens"] == 0 and r64.scheme_params["residual_tokens"] == 64
    assert r64.name != base.name and r64.name.startswith("llama_3_8b_h100_int4_")
    # Every sequence keeps 64 more exact tokens: the residual pool grows, the capacity shrinks.
    assert r64.num_residual_pages == 64 * (64 // r64.page_size + 1) > base.num_residual_pages
    assert r64.capacity_tokens < base.capacity_tokens
    assert any("int4:residual=64: set by --kv" in r for r in r64.reasons)
    # int2 kept at its default residual through the option plans exactly as without it, options aside.
    same, default = _plan("int2:residual=128"), _plan("int2")
    assert same.capacity_tokens == default.capacity_tokens and same.num_residual_pages == default.num_residual_pages
    with pytest.raises(KvgenError, match="not a whole number of 16-token pages"):
        _plan("int4:residual=24", page_size=16)


def test_codegen_uses_the_configured_scheme():
    base, r64 = _plan("int4"), _plan("int4:residual=64")
    assert plan_scheme(r64).residual_tokens == 64
    a, b = kernel_specs(base), kernel_specs(r64)
    assert {op: s.hash for op, s in a.items()} != {op: s.hash for op, s in b.items()}
    # The kernels do not bake the residual window in (the runtime reads it from plan.json), but their
    # specs -- headers, module names, cache keys -- differ, and the package records the options.
    files = render_package(r64)
    assert files["kernels/decode.py"] != render_package(base)["kernels/decode.py"]
    assert b["decode"].name in files["kernels/decode.py"] or b["decode"].hash in files["plan.json"]
    data = json.loads(files["plan.json"])
    assert data["scheme_options"] == {"residual": "64"} and data["scheme_params"]["residual_tokens"] == 64
    stale = dataclasses.replace(r64, scheme_params={**r64.scheme_params, "residual_tokens": 0})
    with pytest.raises(PlanError, match="plan again"):
        kernel_specs(stale)


def test_cli_plan_json_records_options(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--target", "h100", "--json", "--kv"]
    assert main(argv + ["int4:residual=32"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["scheme"] == "int4" and plan["scheme_options"] == {"residual": "32"}
    assert plan["scheme_params"]["options"] == {"residual": "32"} and plan["scheme_params"]["residual_tokens"] == 32
    assert main(["schemes", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows["int4"]["options"]) == ["residual"] and rows["int8"]["options"] == {}
