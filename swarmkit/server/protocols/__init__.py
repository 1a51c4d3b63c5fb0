"""Pure translations between each inference protocol and the shared chat turn (:mod:`swarmkit.server.turn`)."""
