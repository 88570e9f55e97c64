"""Sampling: per-row inputs (metadata, prep), the sampler, structured-output grammars."""
