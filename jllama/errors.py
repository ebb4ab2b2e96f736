"""User-facing errors.

Every error jllama raises for bad input (a missing or malformed file, a tokenizer that does not
fit the checkpoint, an out-of-range setting) is a `JllamaError`. Its message is one line that
names the file, flag or field and says what is wrong, so the CLI can print it as is and exit 1.
"""


class JllamaError(Exception):
    """Base class: a failure caused by the user's input, with a one-line message."""


class ConfigError(JllamaError, ValueError):
    """Model hyperparameters that are inconsistent or out of range."""


class CheckpointError(JllamaError):
    """A checkpoint file that is missing, truncated, too long, or has a bad header."""


class TokenizerError(JllamaError):
    """A tokenizer file that is missing or malformed, or does not match the checkpoint."""


class SamplerError(JllamaError, ValueError):
    """A sampling setting out of range (temperature, top_p, seed)."""


class NumericsError(JllamaError):
    """The model produced NaN or infinite values (usually broken weights)."""


class ResourceError(JllamaError):
    """Not enough memory (or another resource) for what was asked."""


class BackendError(JllamaError):
    """A backend that cannot start (e.g. JAX finds no usable device)."""


class ChatError(JllamaError, ValueError):
    """A chat template that does not compile or fails as it renders, or a malformed message."""


class ConstraintError(JllamaError, RuntimeError):
    """A grammar's matcher refused a token or entered its error state mid-generation (a
    grammar too large for its limits, a token it did not allow): the first line of
    llguidance's message (`jllama.constrain.ConstrainedSampler`)."""
