"""The algorithm: sampling and keyed randomness, the rejection rule, token-tree
acceptance, token histories, the speculative loop and its draft-length policies, the
speculation gate and prompt lookup. Pure functions and small classes on tensors: it
imports torch and specdec.settings, nothing from engine, serving or the CLI."""
