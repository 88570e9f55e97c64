"""DeepSeek-V4.1 (``model_type: deepseek_v41``), built on the V4 components in ../deepseek_v4."""
