"""The specification of Gemma 4 in plain float64 NumPy: config, loaders, forward."""

if __name__ != "gemma4_harness.reference":  # imported by its folder name, a checkout on sys.path: no second copy
    from gemma4_harness import _refuse_folder_name

    _refuse_folder_name(__name__)

from .config import LayerSpec, ModelConfig
from .errors import ConfigError, InputError, ModelFileError, PromptError
from .model import KVCache, forward, greedy_generate
from .weights import Weights, load_model

__all__ = [
    "ConfigError", "InputError", "KVCache", "LayerSpec", "ModelConfig", "ModelFileError", "PromptError",
    "Weights", "forward", "greedy_generate", "load_model",
]
