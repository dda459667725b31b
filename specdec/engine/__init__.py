"""The model engine: loading models (the embedded pair, feature drafts, backends), the
runner with one KV cache per session, kernels, draft precision and compilation, the
draft and target steps. It imports the core, never serving or the CLI."""
