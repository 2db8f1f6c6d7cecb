"""The shared inference engine: a Llama-family model in plain PyTorch, its weights, tokenizer, paged KV cache,
attention (with the context-parallel K/V exchange seam), sampling and a small single-process runner."""
