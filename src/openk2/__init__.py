"""openk2: an open, runnable reproduction of the Kimi K2 system in PyTorch."""

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM

__version__ = "0.1.0"
__all__ = ["K2ForCausalLM", "ModelConfig", "__version__"]
