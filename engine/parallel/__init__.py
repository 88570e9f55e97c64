"""Parallelism of one engine replica. ``eplb``: the expert-parallel load balancer (pure policy:
load statistics, placement planner, re-placement schedule); the distributed MoE layer that
applies its placements comes later."""
