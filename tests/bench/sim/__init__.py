"""Discrete-event cluster simulator for the balancers (``deepinfer bench balance``)."""
