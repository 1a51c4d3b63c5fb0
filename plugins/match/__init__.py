"""Match strategies ``token`` and ``text`` for timeline merging."""

from swarmkit import hookimpl


@hookimpl
def register_match_strategies(register):
    register(
        "text",
        "swarmkit_plugins.match.strategies:TEXT",
        description="blocks match when their text is equal (tolerates tokenizer drift)",
    )
    register(
        "token",
        "swarmkit_plugins.match.strategies:TOKEN",
        description="blocks match when their token ids are equal (strict)",
    )
    register(
        "none",
        "swarmkit_plugins.match.strategies:NONE",
        description="no block matches: every call is its own sample (ablation of merging)",
    )
