"""An OpenAI-compatible HTTP front door to the coordinator (`specdec http`)."""
