"""Where a Hugging Face checkpoint directory keeps its chat template.

Newer checkpoints (transformers >= 4.43 saving) write it to chat_template.jinja; older
ones put it in tokenizer_config.json under "chat_template", either as one string or as
a list of named templates ([{"name": "default", "template": "..."}, {"name": "tool_use",
...}]), of which a plain chat uses "default".
"""

from __future__ import annotations

import json
from pathlib import Path

from workers.model.config import ModelLoadError

__all__ = ["read_chat_template"]

JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def read_chat_template(directory: str | Path) -> str | None:
    """The checkpoint's chat template source, or None when it has none.

    chat_template.jinja wins over tokenizer_config.json. A file that exists but cannot be
    read, or a "chat_template" of the wrong shape, raises ModelLoadError naming the file.
    """
    directory = Path(directory)
    jinja = directory / JINJA_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"{jinja} could not be read: {error}") from error
    config_path = directory / TOKENIZER_CONFIG_FILE
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{config_path} is not readable JSON: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return _template_of(config.get("chat_template"), config_path)


def _template_of(value: object, source: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ModelLoadError(
                    f"{source}: chat_template entries must be {{name, template}} objects, got {type(entry).__name__}"
                )
            if entry["name"] == "default":
                template = entry.get("template")
                if not isinstance(template, str):
                    raise ModelLoadError(f"{source}: chat_template 'default' has no template string")
                return template
        return None  # only named templates (e.g. tool_use, rag): none for a plain chat
    raise ModelLoadError(
        f"{source}: chat_template must be a string or a list of {{name, template}}, got {type(value).__name__}"
    )
