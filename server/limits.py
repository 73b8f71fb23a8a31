"""What strangers may take of the server: each limit a flag of `python -m server`, each refusal an error naming it.

Per address (the connecting IP; of IPv6, its /64: address_group): open connections of either protocol, and
registrations per second (a token bucket: `registration_burst` at once, then `registrations_per_s`); every register
counts, refused or not, so that guessing tokens is as slow as registering; open sockets of any kind, from accept to
close, and new sockets (a token bucket: `new_socket_burst` at once, then `new_sockets_per_s`; each costs the event
loop a handshake or a page load, and those past it are closed as they are accepted, unread; OpenSockets). Per
server: teams; sockets not (yet) a registered team's, the oldest closed past the limit
(OpenSockets). Per register: the length of its strings, and of the frame that holds it. Per team: the bytes it sends
(InboundBudget).
"""
import ipaddress
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from client import protocol

log = logging.getLogger("server")
# Register fields limited by Limits.max_field_chars (the team name has the protocol's own limit).
LIMITED_FIELDS = ("token", "preset", "weights_fingerprint", "session_key")


@dataclass(frozen=True)
class Limits:
    max_teams: int = 64
    max_connections_per_address: int = 16
    registrations_per_s: float = 2.0
    registration_burst: int = 10
    max_field_chars: int = 256
    bad_token_delay_s: float = 1.0  # a wrong token is answered this much later (the connection held meanwhile)
    max_unregistered_sockets: int = 1024  # across all addresses; past it the oldest is closed (OpenSockets)
    # New sockets of one address, accepted or refused later (OpenSockets): each costs the event loop, every team's,
    # ~0.2-0.3 ms once it completes a websocket handshake or a page load. Never a real team's bother: 64 teams behind
    # one NAT connect at once, and each may keep the leaderboard open beside (a page load every 2 s,
    # leaderboard.REFRESH_S, and a browser's favicon request with it): 128 at once, then 64 a second. A flood from
    # one address then costs the loop at most ~2% of its time, where opening and closing sockets as fast as it could
    # it took a whole core's.
    new_socket_burst: int = 128
    new_sockets_per_s: float = 64.0

    def __post_init__(self):
        for name in ("max_teams", "max_connections_per_address", "registrations_per_s", "registration_burst",
                     "max_field_chars", "max_unregistered_sockets", "new_socket_burst", "new_sockets_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.bad_token_delay_s >= 0:
            raise ValueError(f"bad_token_delay_s must be non-negative, got {self.bad_token_delay_s}")


def field_problem(msg: dict, limits: Limits) -> tuple[str, str] | None:
    """("field_too_long", details) for the first string field of a register over its limit, else None (the team
    name is checked against the protocol's own limit, client.protocol.team_name_problem)."""
    for field in LIMITED_FIELDS:
        value = msg.get(field)
        if isinstance(value, str) and len(value) > limits.max_field_chars:
            return ("field_too_long", f"register field {field!r} holds {len(value):,} characters; this server "
                                      f"takes at most {limits.max_field_chars} (--max-field-chars)")
    return None


def longest_register(limits: Limits) -> int:
    """The bytes of the longest register within the field limits (its strings at 4 bytes a character, 1 kB for the
    rest)."""
    return 4 * (len(LIMITED_FIELDS) * limits.max_field_chars + protocol.MAX_TEAM_NAME) + 1024


def register_frame_problem(frame_bytes: int, limits: Limits) -> tuple[str, str] | None:
    """("field_too_long", details) for a frame before register longer than any register within the field limits,
    else None. Such a frame is refused undecoded: decoding a frame of many small values holds the event loop, every
    team's, about half a microsecond a byte (a 4 MB frame of empty lists: 2 s)."""
    most = longest_register(limits)
    if frame_bytes > most:
        return ("field_too_long", f"a frame of {frame_bytes:,} bytes before register; a register within this "
                                  f"server's limits takes at most {most:,} bytes (--max-field-chars)")
    return None


def address_group(address: str) -> str:
    """What the per-address limits count as one address: an IPv4 address, or the /64 of an IPv6 one (a host is given
    a /64 and may speak from any of its 2**64 addresses: counted one by one, it took a limit's worth from each, and
    guessed tokens and filled the server with teams as fast as it liked)."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.IPv6Address(address.split("%", 1)[0])  # (without a scope: fe80::1%eth0)
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
        return str(ip.ipv4_mapped)
    return ip.packed[:8].hex(":", 2) + "::/64"  # (str() of an IPv6Network took 11 us, this 2)


class _Entry:
    __slots__ = ("open", "tokens", "refilled_at")

    def __init__(self, burst, now):
        self.open, self.tokens, self.refilled_at = 0, float(burst), now


class _PerAddress:
    """A table of addresses (address_group's), each with what it holds open and a token bucket (`burst` at once,
    then `per_s`). Addresses with nothing open and a full bucket are as new and forgotten, so that the table stays
    small: looked for once it holds twice what the last look left, so that each look is paid for by as many new
    addresses (looking whenever it held 1,024, a table of addresses that could not be forgotten, sockets open or
    registered in the last half second, was gone over at every new address: 0.5 ms each at 2,000 new addresses a
    second)."""

    FORGET_FROM = 1024  # addresses known before the idle ones are first looked for

    def __init__(self, burst, per_s, clock):
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._addresses: dict[str, _Entry] = {}
        self._forget_at = self.FORGET_FROM

    def _entry(self, address) -> _Entry:
        entry = self._addresses.get(address)
        if entry is None:
            self._forget_idle()
            entry = self._addresses[address] = _Entry(self.burst, self.clock())
        return entry

    def _idle(self, entry) -> bool:
        return not entry.open and self._refill(entry) >= self.burst

    def _forget_idle(self):
        if len(self._addresses) < self._forget_at:
            return
        for address in [a for a, e in self._addresses.items() if self._idle(e)]:
            del self._addresses[address]
        self._forget_at = max(self.FORGET_FROM, 2 * len(self._addresses))

    def _refill(self, entry) -> float:
        now = self.clock()
        entry.tokens = min(float(self.burst), entry.tokens + (now - entry.refilled_at) * self.per_s)
        entry.refilled_at = now
        return entry.tokens


class AddressLimits(_PerAddress):
    """Open connections and registrations (the bucket) of each address."""

    def __init__(self, limits: Limits, clock=time.monotonic):
        super().__init__(limits.registration_burst, limits.registrations_per_s, clock)
        self.limits = limits

    def connect(self, address) -> tuple[str, str] | None:
        """Count a new connection of address; a refusal (code, details) when it has its limit open already
        (then it is not counted)."""
        address = address_group(address)
        entry = self._entry(address)
        if entry.open >= self.limits.max_connections_per_address:
            return ("too_many_connections", f"{entry.open} connections from {address} are open already, "
                                            f"the most this server takes from one address "
                                            f"(--max-connections-per-address); close one and try again")
        entry.open += 1
        return None

    def disconnect(self, address) -> None:
        entry = self._addresses.get(address_group(address))
        if entry is not None and entry.open:
            entry.open -= 1

    def register(self, address) -> tuple[str, str] | None:
        """Spend one registration of address; a refusal when its budget is spent."""
        address = address_group(address)
        entry = self._entry(address)
        if self._refill(entry) < 1.0:
            wait_s = (1.0 - entry.tokens) / self.limits.registrations_per_s
            return ("rate_limited", f"too many registrations from {address}: this server takes "
                                    f"{self.limits.registrations_per_s:g} a second after a burst of "
                                    f"{self.limits.registration_burst} (--registrations-per-s, "
                                    f"--registration-burst); try again in {wait_s:.1f} s")
        entry.tokens -= 1.0
        return None


class OpenSockets(_PerAddress):
    """Sockets open per address, counted from accept to close whatever they turn out to be (a websocket, an
    original-protocol client, a page load, or nothing yet): each idle one is held until a timeout, and one address
    holding thousands would use up the server's file descriptors, so that no team could connect.

    New sockets per address too, a token bucket (`burst` at once, then `per_s`): a socket that completes a websocket
    handshake or a page load costs the event loop, every team's, ~0.2-0.3 ms, and an address that opened and closed
    sockets as fast as it could held its limit of open ones and still took the loop's every turn. Counted at accept,
    where a socket past the rate is refused before a byte of it is read: it costs the server almost nothing.

    Many addresses (an IPv6 /64, a botnet) multiply the per-address limits, so the sockets not (yet) a registered
    team's are also limited across addresses, to `max_unregistered`: a new one past it closes the oldest. Refusing
    the new one instead would lock teams out for as long as the flood lasts; closing the oldest leaves room to a team
    that registers within `max_unregistered` sockets of the flood's."""

    QUIET_S = 60.0  # a socket closed as the oldest, or refused past its rate, after this long without: a new flood

    def __init__(self, per_address: int, max_unregistered: int, clock=time.monotonic, *,
                 burst: int = Limits.new_socket_burst, per_s: float = Limits.new_sockets_per_s):
        super().__init__(burst, per_s, clock)
        self.per_address, self.max_unregistered = per_address, max_unregistered
        self._unregistered: OrderedDict = OrderedDict()  # transport -> None, the oldest first
        self._evicted_at = self._flood_refused_at = -float("inf")

    @property
    def unregistered(self) -> int:
        return len(self._unregistered)

    def open(self, address, transport) -> bool:
        """Count a new socket of address, unregistered, closing the oldest unregistered one when they are at their
        limit; False (not counted) when the address has opened its burst and its rate since (then it spends nothing),
        or holds its limit open already (then it spends one of its bucket all the same)."""
        address = address_group(address)
        entry = self._entry(address)
        if self._refill(entry) < 1.0:
            self._refuse_flood(address)
            return False
        entry.tokens -= 1.0
        if entry.open >= self.per_address:
            return False
        entry.open += 1
        if len(self._unregistered) >= self.max_unregistered:
            self._close_oldest()
        self._unregistered[transport] = None
        return True

    def _refuse_flood(self, address):
        now = self.clock()
        if now - self._flood_refused_at > self.QUIET_S:  # one line a flood, not one a socket
            log.warning("new sockets from %s past %d at once then %g a second, this server's limit "
                        "(--new-socket-burst, --new-sockets-per-s): closing each at once, unread (a flood?)",
                        address, self.burst, self.per_s)
        self._flood_refused_at = now

    def _close_oldest(self):
        oldest, _ = self._unregistered.popitem(last=False)
        now = self.clock()
        if now - self._evicted_at > self.QUIET_S:  # one line a flood, not one a socket
            log.warning("%d sockets open that no team registered, this server's limit (--max-unregistered-sockets): "
                        "closing the oldest for each new one (a flood from many addresses?)", self.max_unregistered)
        self._evicted_at = now
        oldest.abort()  # (its address's count drops at its connection_lost, a turn of the loop later)

    def registered(self, transport) -> None:
        """The socket is a registered team's connection now: never closed to make room."""
        self._unregistered.pop(transport, None)

    def close(self, address, transport) -> None:
        address = address_group(address)
        entry = self._addresses[address]
        entry.open -= 1
        if self._idle(entry):  # as new: forgotten now, not at a look
            del self._addresses[address]
        self._unregistered.pop(transport, None)


class InboundBudget:
    """The bytes a registered team may send, a token bucket checked before a frame is decoded: decoding holds the
    event loop, every team's, up to ~0.4 us a byte (a frame of many small values), and four teams sending 4 MB
    frames held it for seconds. Each request sent grants `per_request` bytes (its answer takes ~25 in msgpack,
    ~200 as an original-protocol line of its own); `allowance` bytes more (heartbeats, notices) refill at
    `allowance_per_s`; what the bucket holds never exceeds the allowance plus the grants of the open requests
    (TeamSession.open_requests: a missed request resent on a reconnect is open again, its bytes granted again once),
    so a team that leaves its requests unanswered saves nothing up."""

    def __init__(self, per_request=512, allowance=64 * 1024, allowance_per_s=16 * 1024, clock=time.monotonic):
        self.per_request, self.allowance, self.allowance_per_s, self.clock = (per_request, allowance,
                                                                               allowance_per_s, clock)
        self.level, self._refilled_at = float(allowance), clock()

    def grant(self, requests: int) -> None:
        self.level += self.per_request * requests

    def take(self, frame_bytes: int, open_requests: int) -> tuple[str, str] | None:
        """Draw a frame's bytes; ("too_much_data", details) when the bucket lacks them (then nothing is drawn)."""
        now = self.clock()
        self.level = min(self.level + (now - self._refilled_at) * self.allowance_per_s,
                         self.allowance + self.per_request * open_requests)
        self._refilled_at = now
        if frame_bytes > self.level:
            return ("too_much_data", f"a frame of {frame_bytes:,} bytes, with {int(self.level):,} left to this team "
                                     f"now: {self.per_request} bytes a request sent and not yet answered, "
                                     f"{self.allowance:,} more refilled at {self.allowance_per_s:,} a second; "
                                     f"the frame was not read")
        self.level -= frame_bytes
        return None
