"""asyncio core: event loop, node daemon and roles, gateway, routers and balancers, metrics."""
