"""The Coordinator gRPC service: runs specdec.loop over the Draft and Target services."""
