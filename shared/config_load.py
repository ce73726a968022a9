"""Reading the settings (shared/config.py) from the environment: ``load``
names the variable in every error (ConfigError), ``load_or_exit`` and
``exit_on_config_error`` stop a process at start with that one line."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NoReturn, TypeVar

import msgspec

from shared.config import BaseSettings, ConfigError

S = TypeVar("S", bound=BaseSettings)

_JSON_FIELDS = {"LLM_PRICES"}


def load(settings_type: type[S], environ: Mapping[str, str] | None = None) -> S:
    """Builds settings from the environment; raises ConfigError naming the variable."""
    environ = os.environ if environ is None else environ
    names = {field.encode_name for field in msgspec.structs.fields(settings_type)}
    raw: dict[str, object] = {}
    for name in names:
        value = environ.get(name)
        if value is None or value == "":
            continue
        if name in _JSON_FIELDS:
            try:
                raw[name] = msgspec.json.decode(value)
            except msgspec.DecodeError as exc:
                raise ConfigError(f"{name} is not valid JSON: {exc}") from None
        else:
            raw[name] = value
    try:
        return msgspec.convert(raw, settings_type, strict=False)
    except msgspec.ValidationError as exc:
        # a contradiction found by __post_init__ arrives here too
        raise ConfigError(_explain(str(exc))) from None


def _explain(message: str) -> str:
    # msgspec says "Expected `int` >= 1 - at `$.QUEUE_MAX`"; lead with the name
    head, sep, where = message.rpartition(" - at `$.")
    if sep:
        return f"{where.rstrip('`')}: {head}"
    return message


def load_or_exit(settings_type: type[S]) -> S:
    """``load`` for a process's ``main()``: a bad setting exits with one line."""
    try:
        return load(settings_type)
    except ConfigError as exc:
        exit_on_config_error(exc)


def exit_on_config_error(exc: ConfigError) -> NoReturn:
    """How a process stops at start for a bad setting, whoever found it: one
    line on stderr naming the variable, exit status 2."""
    sys.stderr.write(f"storyjobs: configuration error: {exc}\n")
    raise SystemExit(2) from None
