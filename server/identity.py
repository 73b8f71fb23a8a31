"""Who may register as which team.

A server may want a token at register: one for everybody (`--token`) or one per team (`--tokens FILE`, a JSON
object {team: token}; only the teams it names may play). A team that registers gets a session key in its
welcome; while its session runs, only a register presenting that key takes the team over (the client's own
reconnect), and anyone else registering the name is refused (team_taken). With per-team tokens the token
already proves the team, so it takes the team over too (a team's client restarted after a crash).

Without per-team tokens anyone names a team, so a new name must be told apart on the leaderboard from the others
(name_problem): "victim " or "Ｖictim" beside "victim" would pass for it, and a name of Hangul fillers shows nothing.
"""
import hmac
import json
import secrets
import unicodedata

from client import protocol


def _unique_teams(pairs):
    seen = set()
    for team, _ in pairs:
        if team in seen:  # json keeps the last silently: the team's other token would be refused
            raise ValueError(f"team {team!r} is given more than once")
        seen.add(team)
    return dict(pairs)


def load_tokens(path: str) -> dict[str, str]:
    """{team: token} from a JSON file holding one object of strings; ValueError in one line otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            tokens = json.load(f, object_pairs_hook=_unique_teams)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tokens {path}: not JSON ({exc.msg} at line {exc.lineno}); write one object "
                         f'{{"team": "token", ...}}') from None
    except ValueError as exc:  # a repeated team, or a file that is not UTF-8
        raise ValueError(f"--tokens {path}: {exc}") from None
    if not isinstance(tokens, dict) or not tokens:
        raise ValueError(f'--tokens {path}: expected one non-empty JSON object {{"team": "token", ...}}')
    for team, token in tokens.items():
        problem = protocol.team_name_problem(team)
        if problem is not None:
            raise ValueError(f"--tokens {path}: {problem}")
        if not isinstance(token, str) or not token:
            raise ValueError(f"--tokens {path}: the token of team {team!r} must be a non-empty string")
    teams_of = {}
    for team, token in tokens.items():
        # a token proves its team here: teams sharing one could each play as, and take over, the other
        if token in teams_of:
            raise ValueError(f"--tokens {path}: teams {teams_of[token]!r} and {team!r} have the same token")
        teams_of[token] = team
    return tokens


MAX_MARKS = 4  # nonspacing marks on one character of a new team's name: more stack over the page's rows around it
_BLANKS = frozenset("\u115f\u1160\u3164\uffa0\u2800")  # printable, yet they print nothing (Hangul fillers, braille)


def looks(team: str) -> str:
    """What a team name reads as on the leaderboard: compatibility forms (fullwidth letters) and case folded, without
    the marks on its letters, its spaces (the page collapses them) or characters that print nothing."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", team).casefold())
    return "".join(c for c in text if not (c.isspace() or c in _BLANKS or unicodedata.category(c).startswith("M")))


def name_problem(team: str, teams) -> tuple[str, str] | None:
    """("bad_team", details) for a new team's name that shows nothing on the leaderboard, stacks marks over its
    neighbours' rows, or reads as the name of one of `teams` does; else None."""
    seen = looks(team)
    if not seen:
        return ("bad_team", f"team name {team!r} shows nothing on the leaderboard: choose another --team")
    marks = 0
    for c in unicodedata.normalize("NFD", team):
        marks = marks + 1 if unicodedata.category(c) in ("Mn", "Me") else 0
        if marks > MAX_MARKS:
            return ("bad_team", f"team name {team[:16]!r}... stacks over {MAX_MARKS} marks on one character: choose "
                                f"another --team")
    for other in teams:
        if looks(other) == seen:
            return ("bad_team", f"team name {team!r} reads as team {other!r} does on the leaderboard: choose "
                                f"another --team")
    return None


def same_secret(given, expected: str) -> bool:
    """given == expected, in time independent of where they differ."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


class Identity:
    """The server's tokens and each team's session key."""

    def __init__(self, token: str | None = None, tokens: dict[str, str] | None = None):
        if token is not None and tokens is not None:
            raise ValueError("give one token for every team (--token) or a token per team (--tokens), not both")
        self.token, self.tokens = token, tokens
        self._keys: dict[str, str] = {}

    def token_problem(self, team: str, token) -> tuple[str, str] | None:
        """("bad_token", details) when the register's token is not the one its team needs, else None."""
        if self.tokens is not None:
            expected = self.tokens.get(team)
            if expected is None:
                return ("bad_token", f"team {team!r} is not in this server's tokens file; ask its organisers")
            if not same_secret(token, expected):
                return ("bad_token", f"register token missing or wrong for team {team!r}")
        elif self.token is not None and not same_secret(token, self.token):
            return ("bad_token", "register token missing or wrong")
        return None

    def takeover_problem(self, team: str, session_key) -> tuple[str, str] | None:
        """None when a register for the known team `team` may take it over (the team's session key, or its own
        token from the tokens file), else ("team_taken", details)."""
        if same_secret(session_key, self._keys[team]) or self.tokens is not None:
            return None
        return ("team_taken", f"team {team!r} is registered by another client; only that client's reconnects "
                              f"(with the session key of its welcome) may play it: choose another --team")

    def issue(self, team: str) -> None:
        """Give a new team its session key."""
        self._keys[team] = secrets.token_urlsafe(24)

    def key_of(self, team: str) -> str:
        return self._keys[team]

    def forget(self, team: str) -> None:
        self._keys.pop(team, None)
