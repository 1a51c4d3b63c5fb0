"""The HTTP face of a swarm server: app factory, routes per resource, errors, middleware, uvicorn runner.

The server's logic without HTTP is :mod:`swarmkit.swarm`.
"""
