"""Configuration mistakes as one line each: the error type every check raises, and the messages for a
misspelled key, an unknown group option or a wrongly typed value (with the valid keys or options nearest
to what was typed), whether Hydra caught it while composing or the schema while typing the result."""

from __future__ import annotations

import difflib

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigValueError(ValueError):
    """A configuration that cannot run: an impossible value or combination, named by its key."""


def fail(key: str, msg: str):
    raise ConfigValueError(f"{key}: {msg}")


def nearest(word: str, choices, n: int = 3) -> list[str]:
    """The choices closest to `word` (difflib's ratio), best first."""
    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.5)


def _quoted_or(names: list[str]) -> str:
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def unknown_key(full_key: str, valid, options_namespace: str | None = None) -> str:
    """`decoding.plans.stock has no key 'blok_size'; did you mean 'block_size'?`"""
    parent, _, key = str(full_key).rpartition(".")
    if not parent and options_namespace and key == options_namespace:
        return (f"'{key}' holds this script's own options, which are added with a +: +{key}.<option>=<value>")
    where = parent or "the config"
    valid = [str(v) for v in valid if not str(v).startswith("_")]
    close = nearest(key, valid)
    if close:
        return f"{where} has no key '{key}'; did you mean {_quoted_or(close)}?"
    return f"{where} has no key '{key}' (its keys: {', '.join(valid) or 'none'})"


def unknown_option(e: MissingConfigException) -> str:
    """`target has no option 'qwen9'; did you mean 'qwen3_8b'? (options: ...)`"""
    group, _, option = str(e.missing_cfg_file or "").rpartition("/")
    options = [o for o in (e.options or []) if not o.endswith("_schema")]
    if not group:  # a primary config or file that does not exist: Hydra's first line says which
        return str(e).splitlines()[0]
    close = nearest(option, options)
    hint = f"; did you mean {_quoted_or(close)}?" if close else ""
    return f"{group} has no option '{option}'{hint} (options: {', '.join(options)})"


def from_omegaconf(e: OmegaConfBaseException, options_namespace: str | None = None) -> str:
    """One line for an OmegaConf error: a misspelled key with the nearest valid ones, else the error's
    first line and the key it concerns."""
    full_key = getattr(e, "full_key", None)
    parent = getattr(e, "parent_node", None)
    if isinstance(e, (ConfigKeyError, AttributeError)) and full_key and hasattr(parent, "keys"):
        return unknown_key(full_key, list(parent.keys()), options_namespace)
    first = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    return f"{full_key}: {first}" if full_key else first


def from_composition(e: Exception, options_namespace: str | None = None) -> str:
    """One line for an exception Hydra raised while composing the config (never its `+key` advice: a
    typed group has no room for new keys)."""
    if isinstance(e, MissingConfigException):
        return unknown_option(e)
    cause = e.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return from_omegaconf(cause, options_namespace)
    lines = [line for line in str(e).splitlines() if line.strip()]
    if isinstance(e, OverrideParseException) and len(lines) > 1:
        return f"{lines[0]}: {lines[1]}"
    return lines[0] if lines else type(e).__name__
