"""Build a :class:`CausalLM` on a device and fill it: from safetensors files, a GGUF file, or random (benchmarks).

A tensor-parallel rank (``model.shard``) reads only its slice of each split
tensor (``safe_open(...).get_slice``), and its random weights are the
slices of the whole model's: every rank count gives the same model. A
GGUF file is dequantized whole (:mod:`kvgen.engine.gguf`) and each rank
keeps its slices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import EngineError
from .model import CausalLM
from .shard import TPShard

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                shard: TPShard | None = None) -> CausalLM:
    """A CausalLM (``shard``: one rank's share), parameters uninitialized, allocated once on ``device`` in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the final dtype: no float32 copy of a large model
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions, shard)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_weights(model: CausalLM, seed: int = 0) -> CausalLM:
    """Fill every weight with N(0, 0.02) (norms 1, biases 0): a model of the right shape, no download."""
    gen = torch.Generator(device=model.model.norm.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif (split := _split(model, name)) is None:
                p.normal_(0.0, 0.02, generator=gen)
            else:  # draw the whole tensor, keep this rank's slice: the same model at every tp
                dim, start, stop, full = split
                shape = list(p.shape)
                shape[dim] = full
                whole = torch.empty(shape, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen)
                p.copy_(whole.narrow(dim, start, stop - start))
    model.setup_rotary()
    return model


def _split(model: CausalLM, name: str) -> tuple[int, int, int, int] | None:
    return None if model.shard is None else model.shard.split_of(name, model.cfg)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{folder} holds no *.safetensors weights; pass a Hugging Face model folder with them")
    return files


def load_weights(model: CausalLM, source: str | Path) -> CausalLM:
    """Copy every tensor of ``source`` into the matching parameter (cast to its dtype).

    ``source``: a folder of safetensors files, or a ``.gguf`` file (its
    tensors dequantized through transformers). Raises EngineError for a
    tensor of the wrong shape or a parameter the checkpoint does not provide
    (tied embeddings share ``embed_tokens``).
    """
    from . import gguf

    params = dict(model.named_parameters())
    seen = _load_gguf(model, params, Path(source)) if gguf.is_gguf(source) else _load_safetensors(model, params,
                                                                                                    Path(source))
    missing = sorted(set(params) - seen)
    if missing:
        raise EngineError(f"the weights lack {len(missing)} tensor(s), e.g. {missing[:3]}; "
                          f"{source} does not hold a complete checkpoint")
    model.setup_rotary()
    return model


Split = tuple[int, int, int]
"""A rank's slice of a checkpoint tensor: ``(dim, start, stop)``."""


def _load_safetensors(model: CausalLM, params: dict[str, torch.nn.Parameter], folder: Path) -> set[str]:
    """Copy every safetensors file's tensors; a rank reads only its rows or columns (``get_slice``)."""
    from safetensors import safe_open

    def read(f, name: str, split: Split | None) -> torch.Tensor:
        if split is None:
            return f.get_tensor(name)
        dim, start, stop = split
        part = f.get_slice(name)
        return part[start:stop] if dim == 0 else part[:, start:stop]

    seen: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            seen |= _copy_in(model, params, path.name, f.keys(),
                             lambda name, f=f: f.get_slice(name).get_shape(),  # the shape, no data read
                             lambda name, split, f=f: read(f, name, split))
    return seen


def _load_gguf(model: CausalLM, params: dict[str, torch.nn.Parameter], path: Path) -> set[str]:
    """Dequantize the GGUF's tensors (in the model's dtype) and copy them, each rank its slices."""
    from . import gguf

    dtype = next(iter(params.values())).dtype
    tensors = gguf.read_tensors(path, list(params), model.cfg.model_type, model.cfg.num_layers, dtype)

    def read(name: str, split: Split | None) -> torch.Tensor:
        t = tensors[name]
        return t if split is None else t.narrow(split[0], split[1], split[2] - split[1])

    return _copy_in(model, params, path.name, tensors, lambda name: tensors[name].shape, read)


def _copy_in(model: CausalLM, params: dict[str, torch.nn.Parameter], source: str, names: Iterable[str],
             shape_of: Callable[[str], Sequence[int]], read: Callable[[str, Split | None], torch.Tensor]) -> set[str]:
    """Copy the checkpoint tensors ``names`` into their parameters (each rank its slice); returns the names copied.

    ``shape_of(name)``: the whole tensor's shape; ``read(name, split)``: the
    tensor (``split`` None) or this rank's slice of it, read only once the
    shape matched. Skips what the model does not keep (``rotary_emb.inv_freq``,
    a tied ``lm_head.weight``: the embedding serves as the head). Raises
    EngineError naming ``source`` for an unknown name or a shape the config
    does not imply.
    """
    seen: set[str] = set()
    for name in names:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
            continue
        p = _param_for(model, params, name, source)
        split = _split(model, name)
        want = list(p.shape)
        if split is not None:
            dim, start, stop, want[dim] = split
        _check_shape(source, name, list(shape_of(name)), want)
        t = read(name, None if split is None else (dim, start, stop))
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        seen.add(name)
    return seen


def _param_for(model: CausalLM, params: dict[str, torch.nn.Parameter], name: str, source: str) -> torch.nn.Parameter:
    p = params.get(name)
    if p is None:
        raise EngineError(f"{source}: unexpected tensor {name}; is this a "
                          f"{model.cfg.model_type} checkpoint matching its config?")
    return p


def _check_shape(source: str, name: str, got: list[int], want: list[int]) -> None:
    if got != want:
        raise EngineError(f"{source}: {name} has shape {got}, the config implies "
                          f"{want}; the config and weights do not match")
