"""Loading a run config: YAML file (with line numbers for errors) <- ``--section.key=value`` overrides, each value
parsed by its field's declared type."""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from k3train.config.schema import SECTIONS, Config
from k3train.runtime.bad_input import ConfigError


# Loading
# --------------------------------------------------------------------------------------------------------------
# A config file must set at least these model keys. Without them the dataclass defaults -- the full-size Kimi K3,
# 2.78T parameters -- would silently fill in the model's scale (an empty YAML used to build the 93-layer model).
REQUIRED_MODEL_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")
_YAML_NULL = "tag:yaml.org,2002:null"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _allows_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """A value YAML already constructed (inside a mapping-typed field) -> annotation ``tp``, scalars by their text."""
    origin = typing.get_origin(tp)
    if isinstance(value, dict) and origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        return {_coerce(k, k_tp, key, where): _coerce(v, v_tp, f"{key}.{k}", where) for k, v in value.items()}
    if isinstance(value, list) and origin is list:
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if value is None and _allows_none(tp):
        return None
    if isinstance(value, (str, int, float, bool)):
        return _parse_text(str(value).lower() if isinstance(value, bool) else str(value), tp, key, where)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{where}")


def _parse_text(text: str, tp: Any, key: str, where: str) -> Any:
    """Parse a value written as text -- a command-line override, or a scalar of the YAML file -- by the field's
    DECLARED type, never by what the text looks like: a ``str`` field keeps the text exactly as written
    (``--train.out_dir=0123`` stays ``"0123"``; YAML rules would make it the number 83), ``int`` is decimal
    (leading zeros allowed), ``float`` must be finite, ``bool`` is true/false/yes/no/on/off, a ``list`` is
    ``[a,b,...]`` or ``a,b,...`` with each item parsed by the item type."""
    origin = typing.get_origin(tp)
    s = text.strip()
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        inner = s[1:-1] if s.startswith("[") and s.endswith("]") else s
        items = [x.strip() for x in inner.split(",")] if inner.strip() else []
        return [_parse_text(_unquote(x), item_tp, f"{key}[{i}]", where) for i, x in enumerate(items)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and s in ("null", "~"):
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _parse_text(text, arg, key, where)
                except ConfigError:
                    pass
        raise ConfigError(f"{key}: {text!r} does not match {tp}{where}")
    if tp is str:
        return text
    if tp is bool:
        if s.lower() in _TRUE + _FALSE:
            return s.lower() in _TRUE
    elif tp is int:
        try:
            return int(s)
        except ValueError:
            pass
    elif tp is float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        if math.isfinite(v):
            return v
    elif origin is dict:
        try:
            return _coerce(yaml.safe_load(text), tp, key, where)
        except yaml.YAMLError:
            pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {text!r}{where}")


def _from_node(node: yaml.Node, tp: Any, key: str, where: str) -> Any:
    """A YAML node of the config file -> a value of annotation ``tp`` (scalars through :func:`_parse_text`)."""
    if isinstance(node, yaml.ScalarNode):
        if node.tag == _YAML_NULL and node.style is None:
            if _allows_none(tp):
                return None
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got an empty value{where}")
        return _parse_text(node.value, tp, key, where)
    if isinstance(node, yaml.SequenceNode) and typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        return [_from_node(n, item_tp, f"{key}[{i}]", where) for i, n in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode) and typing.get_origin(tp) is dict:
        return _coerce(yaml.SafeLoader("").construct_document(node), tp, key, where)
    what = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {what}{where}")


def _set(cfg: Config, sec_name: str, key: str, parse: Any, origin: str) -> None:
    """Set ``sec_name.key`` to ``parse(annotation)`` and remember where the value came from."""
    full = f"{sec_name}.{key}"
    if sec_name not in SECTIONS:
        raise ConfigError(f"unknown section {sec_name!r} in {full!r} (known: {', '.join(SECTIONS)}) ({origin})")
    sec = getattr(cfg, sec_name)
    f = {f.name: f for f in dataclasses.fields(sec)}.get(key)
    if f is None or f.metadata.get("derived"):
        raise ConfigError(f"unknown key {full!r} ({origin})")
    setattr(sec, key, parse(typing.get_type_hints(type(sec))[key]))
    cfg.origins[full] = origin


def _compose(p: Path) -> yaml.Node | None:
    try:
        return yaml.compose(p.read_text(), Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = " ".join(x for x in (e.context, e.problem) if x) or str(e).splitlines()[0]
        at = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        raise ConfigError(f"malformed YAML at {at}: {what}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"malformed YAML in {p}: {str(e).splitlines()[0]}") from None


def _load_file(cfg: Config, p: Path) -> None:
    root = _compose(p)
    model_rule = (f"a config must have a 'model' section setting {', '.join(REQUIRED_MODEL_KEYS)} (the defaults "
                  "are the full-size 2.78T Kimi K3, never filled in silently: configs/k3.yaml spells it out)")
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == _YAML_NULL):
        raise ConfigError(f"model: {p} is empty; {model_rule}")
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"config must be a mapping of sections (model, train, ...) (in {p}:1)")
    seen: set[str] = set()
    model_keys: set[str] = set()
    for k_node, v_node in root.value:
        name, line = str(k_node.value), k_node.start_mark.line + 1
        if name in seen:
            raise ConfigError(f"section {name!r} appears twice (in {p}:{line})")
        seen.add(name)
        if name == "derived":  # written by Config.save for reference; recomputed on load
            continue
        if name not in SECTIONS:
            raise ConfigError(f"unknown section {name!r} (known: {', '.join(SECTIONS)}) (in {p}:{line})")
        if isinstance(v_node, yaml.ScalarNode) and v_node.tag == _YAML_NULL:
            continue
        if not isinstance(v_node, yaml.MappingNode):
            raise ConfigError(f"{name}: expected a mapping of keys (in {p}:{line})")
        keys: set[str] = set()
        for kk, vv in v_node.value:
            key, at = str(kk.value), f"in {p}:{kk.start_mark.line + 1}"
            if key in keys:
                raise ConfigError(f"{name}.{key}: set twice ({at})")
            keys.add(key)
            _set(cfg, name, key, lambda tp, vv=vv, full=f"{name}.{key}", at=at: _from_node(vv, tp, full, f" ({at})"),
                 at)
        if name == "model":
            model_keys = keys
    missing = [k for k in REQUIRED_MODEL_KEYS if k not in model_keys]
    if missing:
        raise ConfigError(f"model: {p} does not set model.{', model.'.join(missing)}; {model_rule}")


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """``["--model.hidden_size=64", "--train.steps", "5"]`` -> ``[(key, value text, argument as written)]``.
    Values stay text: :func:`load_config` parses each by its field's declared type."""
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"bad override {a!r} on the command line: expected --section.key=value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            written = a
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a!r} on the command line has no value")
            k, v = a[2:], args[i + 1]
            written = f"{a} {v}"
            i += 1
        out.append((k, v, written))
        i += 1
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                world_size: int | None = None) -> Config:
    """Load a YAML config, apply command-line overrides and validate. Raises :class:`ConfigError`.

    ``path=None`` starts from the dataclass defaults (for programmatic configs built from overrides); a run
    from the command line always names a file (:func:`k3train.preflight.validate_run`)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        _load_file(cfg, p)
        cfg.source = str(p)
    for full, text, written in parse_overrides(overrides or []):
        sec, _, key = full.partition(".")
        origin = f"from the command line: {written}"
        _set(cfg, sec, key, lambda tp, text=text, full=full, origin=origin: _parse_text(text, tp, full, f" ({origin})"),
             origin)
    return cfg.validate(world_size)
