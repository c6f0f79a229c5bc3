"""The model: its config as an HF config.json states it, the Llama-family and Gemma modules,
their weights and loaders (safetensors, GGUF), RoPE, the tokenizer, tensor-parallel shard layouts,
and the dense linear's MKL/oneDNN choice."""
