"""What a section's check reports through, typed below the sections so that they import nothing of
:class:`k3train.config.schema.Config`: ``need`` (raise one :class:`ConfigError` line for a key unless a condition
holds) and ``origin`` (where values were set, for a message). :meth:`Config.validate` passes its own
:meth:`Config.need` and :meth:`Config.origin`."""
from __future__ import annotations

from typing import Protocol


class Need(Protocol):
    """``need(cond, key, msg, *src)``: raise ``ConfigError("key: msg (where src was set)")`` unless ``cond``;
    ``src`` defaults to ``key`` (:meth:`k3train.config.schema.Config.need`)."""

    def __call__(self, cond: bool, key: str, msg: str, *src: str) -> None: ...


class Origin(Protocol):
    """``origin(*keys)``: where the values of ``keys`` came from -- file and line, command-line argument, or the
    default (:meth:`k3train.config.schema.Config.origin`)."""

    def __call__(self, *keys: str) -> str: ...
