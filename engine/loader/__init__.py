"""Checkpoints: config field reading, safetensors loading, dequantisation, checkpoint writing."""
