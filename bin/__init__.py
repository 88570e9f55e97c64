"""The deepinfer command line."""
