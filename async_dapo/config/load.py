"""Loading a run's config: a YAML file + ``--set a.b=c`` overrides, validated once; any problem is one
ConfigError line naming the dotted key or the rule at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from async_dapo.config.section import ConfigError
from async_dapo.config.root import Config


def _check_path(model: type[BaseModel], dotted: str) -> None:
    """Fail early, naming the whole dotted key, when an override path is not a config field."""
    cls: Any = model
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        fields = getattr(cls, "model_fields", None)
        if fields is None:
            break  # inside a dict-typed field (e.g. engine.extra_args): anything goes
        if part not in fields:
            raise ConfigError(f"{dotted}: unknown key '{part}' (known: {', '.join(sorted(fields))})")
        ann = fields[part].annotation
        cls = next(
            (a for a in (getattr(ann, "__args__", None) or (ann,)) if isinstance(a, type)
             and issubclass(a, BaseModel)),
            None,
        )
        if cls is None and depth < len(parts) - 1 and not _is_dict(fields[part].annotation):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")


def _is_dict(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict or annotation is dict


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", yaml-parsed c)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text}: override must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
    return key.strip(), value


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating the sections on the way."""
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {} if child is None else child
        node = child
    node[leaf] = value


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
        msg = str(err["ctx"]["error"])  # our own rule: drop pydantic's "Value error, " prefix
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    # Cross-field rules (CROSS_FIELD_RULES) sit at the root and name their dotted keys themselves.
    return f"{key}: {msg}{more}" if key else f"{msg}{more}"


def read_yaml_mapping(path: str | Path, kind: str = "config", error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file); ``error`` naming the file on any fault."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: {kind} file not found") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({exc})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise error(f"{path}: top level must be a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML at ``path`` (or defaults), apply ``a.b=c`` overrides, validate; ConfigError on any fault."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = read_yaml_mapping(path)
    for text in overrides or []:
        key, value = parse_override(text)
        _check_path(Config, key)
        set_dotted(tree, key, value)
    return config_from_mapping(tree)


def config_from_mapping(tree: dict[str, Any]) -> Config:
    """Validate a config given as nested sections; ConfigError naming the first key or rule at fault."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def config_yaml(cfg: Config) -> str:
    """The resolved config (all defaults filled in) as YAML, loadable as a config file."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (:func:`config_yaml`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_yaml(cfg))
