"""The quantized CPU runner: weights quantized and packed at load, the matmul paths timed and
chosen per machine, attention's parallel threshold, and the layer loop in one native call."""

# The quantization settings this package serves: int4 (4-bit blocks), int8, gguf (each tensor on its
# own blocks). Besides them: "none" (the checkpoint's weights, dense) and "auto" (the file decides).
MODES = ("int4", "int8", "gguf")
