"""Decode service: the user-facing Generate RPC, routing to a PCP set, KV fetch and batched decoding."""
