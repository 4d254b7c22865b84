"""TensorTurn: train one model on several machines you own (fused DiLoCo or ensemble runs)."""

__version__ = "0.1.0"
