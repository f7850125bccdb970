"""The adapter's former single module, kept so that ``from strata.training import initialize`` goes on
working: the adapter is now split by concern (see strata.engine, where TrainingEngine is)."""

from .engine import TrainingEngine, initialize

__all__ = ["TrainingEngine", "initialize"]
