"""The OpenAI-compatible HTTP gateway: /v1/completions and /v1/chat/completions translated to Decode.Generate."""
