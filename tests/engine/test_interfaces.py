"""The engine's import surface stays light: the CLI and ``from kvgen.engine import LLM`` load no torch."""

from __future__ import annotations

import subprocess
import sys


def test_imports_do_not_load_torch():
    code = ("import sys, kvgen.engine.cli\n"
            "from kvgen.engine import LLM, SamplingParams, EngineError\n"
            "SamplingParams(temperature=0, stop='x')\n"
            "heavy = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_top_level_names_as_in_vllm():
    code = ("import sys\n"
            "from kvgen import LLM, SamplingParams\n"
            "assert 'torch' not in sys.modules\n"
            "from kvgen import LLMEngine, RequestOutput, CompletionOutput\n"
            "import kvgen.engine\n"
            "assert LLM is kvgen.engine.LLM and SamplingParams is kvgen.engine.SamplingParams\n"
            "assert LLMEngine is kvgen.engine.LLMEngine\n"
            "try:\n"
            "    from kvgen import NoSuchThing\n"
            "except ImportError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('unknown names must not import')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_parser_wires_run():
    from kvgen.cli import make_parser
    from kvgen.engine import cli

    args = make_parser("generate").parse_args(["generate", "--model", "m", "--prompt", "hi", "--kv", "int4",
                                               "--temperature", "0.5", "--seed", "3", "--chat", "--max-tokens", "7"])
    assert args._run is cli.run
    assert (args.kv, args.temperature, args.seed, args.chat, args.max_tokens) == ("int4", 0.5, 3, True, 7)


def test_unknown_model_folder_is_a_kvgen_error(tmp_path):
    import pytest

    from kvgen.engine import LLM
    from kvgen.errors import KvgenError

    with pytest.raises(KvgenError, match="no model folder"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(KvgenError, match="not supported"):
        LLM(str(tmp_path))
