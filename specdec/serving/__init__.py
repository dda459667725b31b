"""The serving plumbing: gRPC servers, wire encoding, status mapping, security and
certificates, discovery, the local stack, Ray replicas and the HTTP API. It imports the
engine and the core, never the CLI."""
