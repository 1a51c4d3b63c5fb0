"""The swarm server: Starlette app, episode life cycle, context tracker."""
