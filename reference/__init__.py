"""The specification of Gemma 4 in plain float64 NumPy: config, loaders, forward."""

from .config import LayerSpec, ModelConfig
from .errors import ConfigError, InputError, ModelFileError, PromptError
from .model import KVCache, forward, greedy_generate
from .weights import Weights, load_model

__all__ = [
    "ConfigError", "InputError", "KVCache", "LayerSpec", "ModelConfig", "ModelFileError", "PromptError",
    "Weights", "forward", "greedy_generate", "load_model",
]
