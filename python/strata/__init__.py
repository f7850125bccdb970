"""strata: heterogeneous-memory offload for training large models.

    engine = strata.initialize(model, config)   # any torch.nn.Module; config: dict or JSON path
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
    engine.stats()
    engine.close()   # every tier's memory and NVMe files given back now (or: with strata.initialize(...) as engine:)

``initialize`` (strata.engine) moves the model's parameters, gradients and
optimizer states into strata's chunks; ``load_config`` reads configurations
with the engine's own checks; ``Engine`` is the C++ engine itself.
"""

from ._strata import CorruptionError, Engine, Options, __version__, option_keys
from .config import Config, load_config
from .engine import TrainingEngine, initialize

__all__ = ["Config", "CorruptionError", "Engine", "Options", "TrainingEngine", "initialize", "load_config", "option_keys"]
