"""What a team client's process_batch and submit_batch receive: the two batch formats.

A team client says which format it takes with the class attribute `requests_per_symbol`:
- "many" (team/example_model.py): {symbol: [(unique_id, features[79]), ...]}, each symbol's queued requests in
  arrival order, several of a symbol per step; the answer has one prediction per request.
- "one" (the default: team files written before it existed): {symbol: (unique_id, features)}, at most one request
  per symbol per step, as the original event's rule.
Either way every symbol's requests reach the team client in arrival order across calls, and it answers
{"unique_ids": [...], "predictions": [n, 4], "errors": {unique_id: why}} for what it could not answer, and may name
under "restarted" the requests before which it started their symbols' states afresh on its own (client/answers.py).

A pending step that submit_batch returns may also take joins (team/example_model.py's does): join(unique_id,
symbol, features) -> bool stages a request that arrived while the step waits on the device behind another, and
fate(unique_id) -> True, False or None (not known yet) says whether the step took it; its result() answers those it
took as well. The runtime joins only a request whose symbol has nothing queued before it, and holds that symbol's
later requests back until the fate is known; one the step did not take goes back to the front of its queue.

A pending step may also answer in parts (team/example_model.py's does for a sharded engine, a part a shard):
partial() -> the answer of the requests whose parts have come, never waiting, and wait(timeout) -> whether every
part came within `timeout` seconds. A step whose last parts are late (client/runtime.py LATE_PARTS_S: a hung shard)
is then answered for the parts that came and leaves the pipeline; the symbols of its missing parts wait for them
(their later requests queued) while the other symbols' steps go on, and its result() answers the rest.

A team client may also offer prefetch(symbols), called as requests arrive, and ready(symbol), asked while a step
forms (team/example_model.py's do); one whose states never leave where its steps run says moves_states = False and
the runtime uses neither, unless it says holds_back = True (ready alone then, asked while a step has late parts:
a sharded engine's).

A team client may also export and import its states (team/example_model.py's does where its engine can):
state_layout() -> a JSON-able description of the states' bytes (None: it cannot), export_state(symbol) -> a
pending whose result() is the symbol's state as a uint8 array after the steps submitted before it (None: no state
held), import_state(symbol, data). The journal then checkpoints each symbol's state now and then and lets the
records its states cover go (client/journal.py).
"""
ONE, MANY = "one", "many"
FORMATS = (ONE, MANY)


def requests_per_symbol(team_client) -> str:
    """The team client's declared format (ONE when it declares none)."""
    declared = getattr(team_client, "requests_per_symbol", ONE)
    if declared not in FORMATS:
        raise ValueError(f"{type(team_client).__name__}.requests_per_symbol must be one of {', '.join(FORMATS)}, "
                         f"got {declared!r}")
    return declared


def max_per_symbol(team_client, wanted: int) -> int:
    """Requests of one symbol a step may carry for this team client: `wanted`, or 1 for a one-per-symbol client."""
    return wanted if requests_per_symbol(team_client) == MANY else 1


def moves_states(team_client) -> bool:
    """Whether the team client's prefetch and ready have anything to do (its `moves_states`, True when it does not
    say): a client whose states never leave where its steps run says False, and the runtime then neither wakes a
    thread to prefetch each arrival nor asks ready while a step forms."""
    return getattr(team_client, "moves_states", True) is not False


def holds_back(team_client) -> bool:
    """Whether the team client's ready(symbol) may say False though its states never move (its `holds_back`, False
    when it does not say): a sharded engine's, for the symbols of a shard late to answer, so that they wait alone
    instead of adding steps to those it does not answer. The runtime then asks ready as a step forms while one has
    late parts."""
    return getattr(team_client, "holds_back", False) is True


def state_layout(team_client):
    """The layout of the states the team client exports and imports (its state_layout()), or None where it has
    not all three of state_layout, export_state and import_state, or says None: the journal then keeps every record
    of the session (client/journal.py)."""
    if not all(callable(getattr(team_client, name, None)) for name in ("state_layout", "export_state",
                                                                        "import_state")):
        return None
    return team_client.state_layout()


def steps_in_background(team_client) -> bool:
    """Whether the team client's submit_batch returns while its step runs (the fast engine on one GPU) and the
    pending step's done() says when it has ended (its `steps_in_background`, False when it does not say): the
    runtime then submits and polls from its event loop by default (inline steps, runtime.py)."""
    return callable(getattr(team_client, "submit_batch", None)) and getattr(team_client, "steps_in_background",
                                                                            False) is True


def step_symbols(team_client) -> int | None:
    """Symbols one step of the team client holds (its `max_batch`, e.g. the example's engine's), None when it
    does not say: the runtime forms a step at once when it is already full (runtime.py, _submit_in)."""
    value = getattr(team_client, "max_batch", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def step_rows(team_client) -> tuple[int, ...]:
    """The row counts the team client's steps of several requests a symbol run at (its `step_rows`, e.g. the
    example's engine's captured shapes), sorted; () when it does not say. The runtime's step clock learns step times
    at these sizes (client/step_clock.py)."""
    value = getattr(team_client, "step_rows", ())
    try:
        rows = sorted(value)
    except TypeError:
        return ()
    return tuple(rows) if all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in rows) else ()


def batch_for(team_client, requests) -> dict:
    """The team client's batch of `requests` (scheduler Requests grouped by symbol, each symbol's in order)."""
    if requests_per_symbol(team_client) == ONE:
        batch = {r.symbol: (r.unique_id, r.features) for r in requests}
        if len(batch) != len(requests):
            raise ValueError("a one-request-per-symbol team client was given several requests of one symbol")
        return batch
    batch = {}
    for r in requests:
        batch.setdefault(r.symbol, []).append((r.unique_id, r.features))
    return batch


def queued(value) -> list:
    """A symbol's entry of a batch as a list of (unique_id, features): a list as given, or the one request of a
    one-per-symbol batch, so a team client taking lists also takes the older format."""
    if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], tuple):
        return [value]
    return list(value)
