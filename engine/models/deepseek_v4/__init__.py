"""DeepSeek-V4 (``model_type: deepseek_v4``) built for serving: varlen batches over paged
compressed blocks and per-sequence SWA slots."""
