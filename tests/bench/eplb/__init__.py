"""Pieces of ``deepinfer bench eplb``: DeepSeek's EPLB as the baseline, traces (synthetic and
recorded from the tiny model) and the replay that measures placements over a trace."""
