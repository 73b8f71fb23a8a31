"""Scoring server: streams requests to each team over websockets and scores the answers live."""
from server.app import ScoringServer, ServerConfig

__all__ = ["ScoringServer", "ServerConfig"]
