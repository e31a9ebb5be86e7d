"""What a served model is made of before it is loaded: its name, path, version label and engine options
(`ModelSpec`), read from `--model NAME=PATH` (repeatable) or `--models-config FILE` (YAML or JSON), and the short
hash of its effective configuration that traces every request and audit entry to it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config import EngineConfig

# Names the admin API accepts for models and aliases: letters, digits, `.`, `_`, `-`, each part starting with a
# letter or digit, at most one `org/` part (Hugging Face style, as vLLM's served model names), up to 128 characters.
# So a name never holds a line break, markup, a space or `..`, and never clashes with the admin routes' own parts.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
MAX_NAME_CHARS = 128
VERSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


def name_error(name: str, what: str = "model name") -> str | None:
    """Why `name` cannot be an admin-given model or alias name (None: it can). Never echoes the name."""
    if len(name) > MAX_NAME_CHARS:
        return f"a {what} has at most {MAX_NAME_CHARS} characters"
    if NAME_PATTERN.fullmatch(name) is None or "/" in name and name.rsplit("/", 1)[1] in ("sleep", "wake"):
        return (f"a {what} is letters, digits, '.', '_' and '-', starting with a letter or digit, with at most "
                "one 'org/' prefix")
    return None


def version_error(version: str) -> str | None:
    if VERSION_PATTERN.fullmatch(version) is None:
        return "a version is up to 64 letters, digits, '.', '_', '+' and '-', starting with a letter or digit"
    return None


# Engine options that never enter the hash or /v1/config (secrets), or are the model itself (the spec's path).
_HIDDEN_OPTIONS = {"kv_transfer_secret"}


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve. `options` are EngineConfig fields (the same names as the CLI flags, with underscores)
    that override the command line's engine options for this model; `path` becomes EngineConfig.model."""

    name: str
    path: str | None = None  # None: the default model (smollm2-135m)
    version: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"invalid model name {self.name!r}")
        unknown = sorted(set(self.options) - set(EngineConfig.option_names()) - {"model"})
        if unknown:
            raise ValueError(f"model {self.name!r}: unknown engine options {unknown}")
        if "model" in self.options:
            raise ValueError(f"model {self.name!r}: give the model as `path`, not as the option `model`")

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The command line's engine options with this model's path and options on top (validated)."""
        return dataclasses.replace(base, model=self.path, **self.options)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        unknown = sorted(set(d) - {"name", "path", "version", "options"})
        if unknown:
            raise ValueError(f"model entry: unknown keys {unknown}; known: name, path, version, options")
        if not isinstance(d.get("name"), str):
            raise ValueError("model entry: `name` (a string) is required")
        version = d.get("version")
        options = d.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"model {d['name']!r}: `options` must be a mapping")
        return cls(d["name"], d.get("path"), None if version is None else str(version), dict(options))


def effective_options(cfg: EngineConfig) -> dict[str, Any]:
    """The engine options a model runs with, as JSON values (secrets left out)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _HIDDEN_OPTIONS}


def config_hash(options: dict[str, Any]) -> str:
    """12 hex digits of sha256 over the canonical JSON of the effective options: equal options, equal hash."""
    text = json.dumps(options, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def parse_model_arg(value: str) -> ModelSpec:
    """`NAME=PATH`, or a path (its name: the file or directory name without `.gguf`; `smollm2-135m` as is)."""
    name, sep, path = value.partition("=")
    if sep and name and "/" not in name and not Path(value).exists():
        return ModelSpec(name, path or None)
    stem = Path(value).name
    return ModelSpec(stem[:-5] if stem.endswith(".gguf") else stem, value)


@dataclass
class ModelsConfig:
    """Everything `--models-config` holds: the models in order (the first is the default) and aliases."""

    models: list[ModelSpec]
    aliases: dict[str, str] = field(default_factory=dict)


def load_models_config(path: str | Path) -> ModelsConfig:
    """A YAML or JSON file: `{"models": [{"name", "path", "version", "options"}...], "aliases": {alias: name}}`,
    or just the list of models."""
    import yaml  # JSON is YAML: one parser for both

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if isinstance(data, list):
        data = {"models": data}
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ValueError(f"{path}: expected a list of models or a mapping with a non-empty `models` list")
    unknown = sorted(set(data) - {"models", "aliases"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: models, aliases")
    aliases = data.get("aliases") or {}
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise ValueError(f"{path}: `aliases` must map alias names to model names")
    return ModelsConfig([ModelSpec.from_dict(m) for m in data["models"]], {str(k): v for k, v in aliases.items()})


def check_names(specs: list[ModelSpec], aliases: dict[str, str]) -> None:
    """Model names unique, aliases distinct from models and pointing at one."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}")
    for alias, target in aliases.items():
        if alias in names:
            raise ValueError(f"alias {alias!r} is also a model name")
        if target not in names:
            raise ValueError(f"alias {alias!r} points at {target!r}, which is not a model")
