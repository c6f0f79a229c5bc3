"""The quantized CPU runner: weights quantized and packed at load, the matmul paths timed and
chosen per machine, attention's parallel threshold, and the layer loop in one native call."""
from verifier.quantized.modes import MODES

__all__ = ["MODES"]
