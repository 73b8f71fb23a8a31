"""asyncio.run on uvloop where it is installed: its event loop and TCP transports are written in C, so each
websocket message costs less Python on both ends of the connection (the client and the scoring server).

EVENT_LOOP=asyncio forces the standard loop, EVENT_LOOP=uvloop requires uvloop; unset, uvloop when importable.
"""
import asyncio
import os

CHOICES = ("asyncio", "uvloop")


def loop_factory():
    """The event loop constructor that EVENT_LOOP (or, unset, the installed packages) selects."""
    choice = os.environ.get("EVENT_LOOP", "").strip().lower()
    if choice not in ("", *CHOICES):
        raise ValueError(f"EVENT_LOOP must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ImportError("EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main):
    """asyncio.run(main) on the selected event loop."""
    try:
        factory = loop_factory()
    except (ValueError, ImportError):
        main.close()  # never to run: else a "never awaited" warning follows the error's one line
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
