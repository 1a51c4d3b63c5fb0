"""The dashboard: a read-only web view of one swarm server, behind the admin token.

- :mod:`.session`: the login session (an HttpOnly, SameSite=Strict cookie; the
  token itself never travels in a URL);
- :mod:`.data`: what the pages show, as JSON built from the server's state, its
  ``metrics.jsonl`` and its episodes (pure functions over those);
- ``static/``: the page, its script and its style, plain files vendored in the
  package (no CDN: the dashboard works offline).

The routes are in :mod:`swarmkit.server.routes.dashboard`.
"""
