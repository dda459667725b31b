"""The Draft gRPC service: proposes tokens and q with the draft model's KV caches."""
