"""Bad input: one line naming the problem, exit code 2, before any work starts.

Every entry point (``k3train``, ``python -m k3train.train``, the tools) reports a bad config, a bad file or a bad
argument the same way: the exception types here, the exit code here."""
from __future__ import annotations

EXIT_BAD_INPUT = 2


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and, when known, the file."""
