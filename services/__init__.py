"""pcpstack: disaggregated LLM serving with prefill context parallelism over gRPC."""
