"""The one exception type that the command line turns into a one-line message.

Raise `GlassError` (or a subclass) at a boundary -- config, prompt length, weight
loading, data files -- with a message that holds the bad value and the fix.
The CLI prints `error: <message>` and exits with code 2; library callers get a
normal exception they can catch.
"""


class GlassError(Exception):
    """A user-facing error: the message says what was wrong and what to do."""


class ConfigError(GlassError, ValueError):
    """A model configuration that cannot be built."""


class CheckpointError(GlassError):
    """Weights or a checkpoint that cannot be loaded."""


class PromptError(GlassError, ValueError):
    """A prompt that the model cannot take (empty, too long)."""
