"""Every exception (and the two warnings) that glassgpt raises on purpose.

Raise a `GlassError` subclass at a boundary -- a flag, a config, a file, a prompt --
with a message that holds the bad value and the fix. The command line prints
`error: <message>` and exits with code 2; library callers get a normal exception
they can catch, by its kind or as a `GlassError`.
"""


class GlassError(Exception):
    """A user-facing error: the message says what was wrong and what to do."""


class ConfigError(GlassError, ValueError):
    """A model configuration that cannot be built."""


class CheckpointError(GlassError):
    """Weights or a checkpoint that cannot be loaded (or saved)."""


class PromptError(GlassError, ValueError):
    """A prompt that the model cannot take (empty, too long, an id out of range)."""


class UnreadableModelError(GlassError):
    """A model object of no kind glassgpt can describe: the message names what was looked for and the kinds read."""


class NonFiniteError(GlassError):
    """A model whose scores came out NaN or infinite: its weights are broken (a run that diverged)."""


class TokenizerError(GlassError):
    """A tokenizer that cannot be built, or an id it does not have."""


class DataError(GlassError):
    """Training text or a finetuning file that cannot be used: missing, empty, binary, not UTF-8, too short."""


class TrainError(GlassError):
    """Training settings or a run directory that training cannot use, or a run that diverged."""


class RunDirError(GlassError):
    """A run directory that cannot be used now: another process trains in it, or it cannot be written."""


class TraceCancelled(Exception):
    """A trace stopped early because its `cancel` event was set (e.g. the web page's client left).

    Not a GlassError: nothing was wrong with the input, and the web app turns it into a closed
    connection, not an error message."""


class RandomWeightsWarning(UserWarning):
    """`load_model` built a preset (or a config file) with random weights, not trained ones."""


class KernelWarning(UserWarning):
    """glassgpt's own CPU kernels could not be built or loaded here; PyTorch's operators run instead."""


class CacheWarning(UserWarning):
    """A file in glassgpt's cache (a kernel library, the autotune's timings) could not be trusted (cut short,
    changed, unreadable) and was made again, or could not be kept: the command line says it as one note."""
