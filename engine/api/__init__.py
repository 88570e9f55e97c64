"""What callers of an engine use: AsyncEngine, LLM, SamplingParams, outputs, the engine's protocol and errors."""
