"""The Coordinator gRPC service: runs specdec.core.loop over the Draft and Target services."""
