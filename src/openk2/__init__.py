"""openk2: an open, runnable reproduction of the Kimi K2 system in PyTorch."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["K2ForCausalLM", "ModelConfig", "__version__"]

if TYPE_CHECKING:
    from openk2.config import ModelConfig
    from openk2.model import K2ForCausalLM


def __getattr__(name: str):
    # Lazy, so that commands which never build a model (tokenizer, plots) do not pay torch's import time.
    if name == "ModelConfig":
        from openk2.config import ModelConfig

        return ModelConfig
    if name == "K2ForCausalLM":
        from openk2.model import K2ForCausalLM

        return K2ForCausalLM
    raise AttributeError(f"module 'openk2' has no attribute {name!r}")
