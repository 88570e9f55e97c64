"""Tokens <-> text: tokenizer, detokenizer, chat template, output deltas (stop strings, logprobs)."""
