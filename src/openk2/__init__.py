"""openk2: an open, runnable reproduction of the Kimi K2 system in PyTorch."""

__version__ = "0.1.0"
