"""loracls: fine-tune a small decoder-only language model as a text classifier with LoRA."""

from loracls.config import TrainConfig
from loracls.errors import LoraclsError

__all__ = ["LoraclsError", "TrainConfig", "from_pretrained"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`loracls.from_pretrained` without importing torch for every `import loracls`."""
    if name == "from_pretrained":
        from loracls.model import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'loracls' has no attribute {name!r}")
