"""Errors for bad input: each carries one line naming the file, key or tensor.

The CLI turns any :class:`InputError` into that one line on stderr and exit
code 2. Anything else escaping is a bug in the harness, not bad input.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: a file, key, tensor or prompt that is not what was expected.

    ``str(err)`` is a single line suitable for printing as is.
    """


class ConfigError(InputError):
    """Invalid, missing or contradictory model metadata (a GGUF key or an HF config field)."""


class ModelFileError(InputError):
    """A model file that cannot be used: not GGUF, truncated, wrong architecture,
    missing or mis-shaped tensor, unsupported quant type, NaN/Inf in a weight."""


class PromptError(InputError):
    """A prompt that the model cannot take: empty, a token id out of range, longer than the context."""
