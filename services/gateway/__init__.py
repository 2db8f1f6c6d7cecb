"""The OpenAI-compatible HTTP gateway: /v1/completions and /v1/chat/completions over Decode.Generate."""
