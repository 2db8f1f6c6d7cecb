"""Prefill service: context-parallel prefill across PCP ranks, one complete KV replica pushed per request."""
