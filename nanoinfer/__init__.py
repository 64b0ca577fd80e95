"""nanoinfer: a small, fast LLM inference and serving engine."""

__version__ = "0.1.0"
