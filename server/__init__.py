"""Scoring server: streams requests to each team over websockets and scores the answers live."""

__all__ = ["ScoringServer", "ServerConfig"]


def __getattr__(name):
    # Imported when first asked for, so that `python -m server` runs its own module first (it sets up Ctrl-C
    # before the imports, which take a while).
    if name in __all__:
        from server import app
        return getattr(app, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
