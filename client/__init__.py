"""Streaming inference client for the recurrent ensemble: protocol, runtime, engines."""
