"""strata: heterogeneous-memory offload for training large models.

So far the package reads configurations (``load_config``) with the engine's
own checks; the PyTorch adapter (``strata.initialize``) is being built on it.
"""

from ._strata import Options, option_keys
from .config import Config, load_config

__all__ = ["Config", "Options", "load_config", "option_keys"]
