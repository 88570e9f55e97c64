"""DeepInfer: a serving stack for the DeepSeek-V4 model family.

The public API (vLLM's shapes) is imported lazily so that ``import deepinfer`` stays cheap
and does not pull torch into processes that never touch a model (storage nodes, routers).
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("deepinfer.engine.api.llm", "LLM"),
    "SamplingParams": ("deepinfer.engine.api.sampling_params", "SamplingParams"),
    "AsyncEngine": ("deepinfer.engine.api.async_engine", "AsyncEngine"),
    "RequestOutput": ("deepinfer.engine.api.outputs", "RequestOutput"),
    "CompletionOutput": ("deepinfer.engine.api.outputs", "CompletionOutput"),
    "Logprob": ("deepinfer.engine.api.outputs", "Logprob"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value
