"""The continuous-batching scheduler and its parts (admission, budget, running, emit, commit, queue), cost model."""
