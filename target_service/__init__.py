"""The Target gRPC service: verifies proposals next to p with the target's KV caches."""
