"""Load a model by name: a random-weight preset or a Hugging Face checkpoint directory.

A checkpoint directory holds config.json, tokenizer.json and safetensors weights
(model.safetensors, or shards listed in model.safetensors.index.json). Every way it can
be unusable raises ModelLoadError naming the file, field or tensor, because the person
reading it is deciding what to download or fix, and "KeyError: 'model'" does not help.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from workers.model.chat_template_file import read_chat_template
from workers.model.config import ModelConfig, ModelLoadError
from workers.model.llama import LlamaModel, build_empty_model
from workers.model.tokenizer import HFTokenizer, Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "load_checkpoint", "load_model"]

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_NAMES_IN_ERROR = 10


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: weights on their device, in eval mode, no gradients.

    memory_profiles: the device memory measured once per (step tokens, sampled rows)
    profile (workers/model/memory.py); kept here because it can only be measured before
    a KV pool takes the device, and sizing may be asked for again afterwards.
    """

    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    memory_profiles: dict[tuple[int, int], Any] = field(default_factory=dict, compare=False, repr=False)


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A model by name or path, tried in this order:

    1. a preset (random weights from `seed`): tiny, small, ...
    2. a named real model (workers/model/named_models.py), e.g. smollm2-135m-instruct
    3. a .gguf file, or a directory holding exactly one .gguf and no config.json
    4. a Hugging Face checkpoint directory (config.json, tokenizer.json, safetensors)
    """
    # Imported here because presets and gguf_checkpoint build LoadedModel values from this module.
    from workers.model.gguf_checkpoint import load_gguf
    from workers.model.named_models import NAMED_MODELS, resolve_named_model
    from workers.model.presets import PRESETS, build_preset

    if name_or_path in PRESETS:
        return build_preset(name_or_path, device, dtype, seed=seed)
    if name_or_path in NAMED_MODELS:
        return load_gguf(resolve_named_model(name_or_path), device, dtype, name=name_or_path)
    path = Path(name_or_path)
    if path.suffix == ".gguf" and not path.is_dir():
        return load_gguf(path, device, dtype)  # a missing file is an error naming it
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_checkpoint(path, device, dtype)
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return load_gguf(gguf_files[0], device, dtype)
        if len(gguf_files) > 1:
            raise ModelLoadError(
                f"directory {path} holds {len(gguf_files)} .gguf files, give one of them as the model: "
                f"{', '.join(f.name for f in gguf_files)}"
            )
        return load_checkpoint(path, device, dtype)
    raise ModelLoadError(
        f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}), a named model "
        f"({', '.join(NAMED_MODELS)}), a .gguf file nor an existing checkpoint directory"
    )


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load a Hugging Face checkpoint directory of a Llama, Qwen2 or Mistral model.

    Tensors the model does not use (e.g. rotary inv_freq buffers, a redundant lm_head
    under tied embeddings) are ignored; a tensor it needs that is missing or has the
    wrong shape is an error.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"checkpoint directory {directory} not found")
    config_path = directory / "config.json"
    config = ModelConfig.from_hf_dict(_read_json(config_path), source=str(config_path))

    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ModelLoadError(f"{tokenizer_path} not found (a tokenizers tokenizer.json is required)")
    chat_template = read_chat_template(directory)  # outside the try: its errors name their own file
    try:
        tokenizer = HFTokenizer(tokenizer_path, config.bos_token_id, config.eos_token_ids, chat_template=chat_template)
    except Exception as error:  # the tokenizers library raises a bare Exception
        raise ModelLoadError(f"{tokenizer_path} could not be read: {error}") from error

    shards = _weight_files(directory)
    model = build_empty_model(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for number, shard in enumerate(shards, start=1):
        print(f"loading shard {number}/{len(shards)} {shard.name}", file=sys.stderr, flush=True)
        try:
            tensors = load_file(str(shard), device="cpu")
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{shard} is not a readable safetensors file: {error}") from error
        for name, tensor in tensors.items():
            if name not in expected:
                continue
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(
                    f"tensor {name} in {shard} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {expected[name]}"
                )
            # Cast and move tensor by tensor so host memory peaks at one shard.
            state[name] = tensor.to(device=device, dtype=dtype)
        del tensors

    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_IN_ERROR])
        hidden = len(missing) - _MAX_NAMES_IN_ERROR
        more = f" (and {hidden} more)" if hidden > 0 else ""
        raise ModelLoadError(f"missing tensors in checkpoint {directory}: {shown}{more}")

    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.fuse_projections()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=directory.name)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files to read, in a stable order."""
    index_path = directory / _INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no weight_map")
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise ModelLoadError(f"{shard} listed in {index_path} not found")
        return shards
    single = directory / _SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    if not others:
        raise ModelLoadError(f"no *.safetensors weights in {directory}")
    return others
