"""strata: heterogeneous-memory offload for training large models.

So far the package reads configurations (``load_config``) with the engine's
own checks and drives the engine as far as packing tensors into chunks
(``Engine``); the PyTorch adapter (``strata.initialize``) is being built on it.
"""

from ._strata import Engine, Options, option_keys
from .config import Config, load_config

__all__ = ["Config", "Engine", "Options", "load_config", "option_keys"]
