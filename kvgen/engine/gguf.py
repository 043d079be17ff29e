"""GGUF checkpoints for the engine: a ``.gguf`` file's config, tokenizer and (dequantized) weights.

A GGUF file holds everything a Hugging Face folder does: the config in its
metadata, the tokenizer, and the tensors under llama.cpp's names, often
quantized (Q4_1, Q8_0, ...). The engine reads all three through
transformers' GGUF support, which needs the ``gguf`` package (the ``eval``
extra: ``pip install 'kvgen[eval]'``): ``AutoConfig``/``AutoTokenizer``
with ``gguf_file=``, and ``load_gguf_checkpoint`` for the tensors,
dequantized to float and renamed to Hugging Face names (with llama.cpp's
q/k row permutation undone), which :func:`kvgen.engine.weights.load_weights`
then copies into the engine's own model. Nothing is downloaded.

How a GGUF is named (as transformers does): ``model="path/to/model.gguf"``,
or ``model=folder, gguf_file="name.gguf"``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import types
from pathlib import Path
from typing import Any

import torch

from .errors import EngineError

SUFFIX = ".gguf"


class GGUFError(EngineError):
    """A GGUF file the engine cannot read: missing, not GGUF, of an unsupported architecture, or no ``gguf`` package."""


def is_gguf(path: str | Path) -> bool:
    """True when ``path`` names a file ending in ``.gguf`` (case-insensitive)."""
    return str(path).lower().endswith(SUFFIX)


def resolve(model: str | Path | None, gguf_file: str | Path | None) -> Path | None:
    """The GGUF file that ``model`` (and ``gguf_file``) name, or None for a Hugging Face folder.

    ``model`` a ``.gguf`` path: that file. ``gguf_file`` given: a file in the
    folder ``model`` (or, absolute, the file itself). Raises GGUFError when
    the named file does not exist.
    """
    if gguf_file is not None:
        g = Path(gguf_file).expanduser()
        path = g if g.is_absolute() or model is None else Path(model).expanduser() / g
    elif model is not None and is_gguf(model):
        path = Path(model).expanduser()
    else:
        return None
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {path}; pass an existing .gguf file (or a folder and gguf_file=NAME in it)")
    return path


def require() -> None:
    """Raise GGUFError (one line) unless the ``gguf`` package that transformers reads GGUF with is importable."""
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError("loading a GGUF file needs the gguf package; pip install 'kvgen[eval]' (or pip install gguf)")


# What transformers and gguf raise for a file they cannot read: OSError (unreadable), ValueError (not GGUF,
# an architecture transformers does not map), KeyError (a missing metadata key), NotImplementedError (a
# quantization type gguf cannot dequantize). Anything else is a bug and propagates.
_READ_ERRORS = (OSError, ValueError, KeyError, NotImplementedError)


@contextlib.contextmanager
def _reading(path: Path, what: str):
    """Turn a read failure of ``what`` in ``path`` into one GGUFError line (the first line of the cause)."""
    try:
        yield
    except _READ_ERRORS as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GGUFError(f"could not read the {what} of {path}: {first}") from None


def hf_config(path: Path) -> Any:
    """The transformers config that the GGUF's metadata describes (``AutoConfig`` with ``gguf_file``)."""
    require()
    from transformers import AutoConfig

    with _reading(path, "config"):
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def tokenizer(path: Path) -> Any:
    """The tokenizer stored in the GGUF (``AutoTokenizer`` with ``gguf_file``), or None when it stores none.

    Without a tokenizer (no ``tokenizer.ggml.model`` key) the engine takes token-id prompts only.
    """
    require()
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    with _reading(path, "tokenizer"):
        if "tokenizer.ggml.model" not in GGUFReader(str(path)).fields:
            return None
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _gguf_arch(model_type: str) -> str:
    """llama.cpp's architecture name for a config's ``model_type`` (Mistral files are written as llama)."""
    return "llama" if model_type == "mistral" else model_type


def read_tensors(path: Path, names: list[str], model_type: str, num_layers: int,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF that maps to one of ``names`` (Hugging Face names), dequantized, in ``dtype``.

    transformers maps the names (through ``gguf``'s tensor-name tables for
    the architecture) and undoes llama.cpp's q/k permutation; GGUF tensors
    with no counterpart among ``names`` (e.g. ``rope_freqs``) are left out.
    """
    require()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # load_gguf_checkpoint maps names through a model's state_dict(); the engine's
    # parameters already carry the Hugging Face names, so a name-only stand-in will do
    shim = types.SimpleNamespace(
        config=types.SimpleNamespace(model_type=_gguf_arch(model_type), num_hidden_layers=num_layers),
        state_dict=lambda: dict.fromkeys(names), named_children=lambda: iter(()))
    with _reading(path, "tensors"):
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shim, torch_dtype=dtype)
    return parsed["tensors"]
