"""zkv: hierarchical KV-cache manager (device / pinned host / storage) for LLM serving."""

__version__ = "0.1.0"
__all__ = ["__version__"]
