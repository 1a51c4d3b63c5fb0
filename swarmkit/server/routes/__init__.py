"""The server's endpoints, one module per resource.

- :mod:`.openai`, :mod:`.chat`, :mod:`.completions`: the OpenAI-compatible API at each episode's ``base_url``.
- :mod:`.episodes`: register, report, abort, read episodes; client ready votes.
- :mod:`.admin`: the controller API (configure, start, stop, restart, status, checkpoint).
"""
