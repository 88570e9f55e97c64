"""Erasure-coded storage cluster: codec, fragment store, GC policy, placement, node daemon, client."""
