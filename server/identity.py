"""Who may register as which team.

A server may want a token at register: one for everybody (`--token`) or one per team (`--tokens FILE`, a JSON
object {team: token}; only the teams it names may play). A team that registers gets a session key in its
welcome; while its session runs, only a register presenting that key takes the team over (the client's own
reconnect), and anyone else registering the name is refused (team_taken). With per-team tokens the token
already proves the team, so it takes the team over too (a team's client restarted after a crash).

Without per-team tokens anyone names a team, so a new name must be told apart on the leaderboard from the others
(name_problem): "victim " or "Ｖictim" beside "victim" would pass for it, as would "vіctіm" of Cyrillic і
(LATIN_LOOKALIKES), and a name of Hangul fillers shows nothing.
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


# Cyrillic and Greek letters that look like a Latin one, each read as that letter: a table of look-alikes after
# Unicode's confusables (confusables.txt of UTS #39), not all of them. Capital and small forms are listed apart, as
# each looks like its own Latin letter (Greek capital eta like H, its small form like n), so that this folding,
# done before case is, tells apart two names that differ only in the case of such a letter: name_problem also
# compares the names with case folded alone. Letters of these scripts that look like no Latin letter stay as
# they are, so that a name wholly in Cyrillic or Greek plays beside every other it does not read as.
LATIN_LOOKALIKES = {
    # Latin: (Cyrillic, Greek)
    "a": ("\u0410\u0430", "\u0391\u03b1"),  # А а, Α α
    "b": ("\u0412\u0432", "\u0392"),  # В в (small: a small capital B), Β
    "c": ("\u0421\u0441", ""),  # С с
    "d": ("\u0501", ""),  # ԁ (Komi de)
    "e": ("\u0415\u0435", "\u0395"),  # Е е, Ε
    "h": ("\u041d\u043d\u04ba\u04bb", "\u0397"),  # Н н (small: a small capital H), Һ һ (shha), Η
    "i": ("\u0406\u0456\u04c0", "\u0399\u03b9"),  # І і, Ӏ (palochka, capital), Ι ι
    "j": ("\u0408\u0458", "\u037f\u03f3"),  # Ј ј, Ϳ ϳ (yot)
    "k": ("\u041a\u043a", "\u039a\u03ba"),  # К к, Κ κ
    "l": ("\u04cf", ""),  # ӏ (palochka, small)
    "m": ("\u041c\u043c", "\u039c"),  # М м, Μ
    "n": ("", "\u039d\u03b7"),  # Ν, η (small eta)
    "o": ("\u041e\u043e", "\u039f\u03bf"),  # О о, Ο ο
    "p": ("\u0420\u0440", "\u03a1\u03c1"),  # Р р, Ρ ρ
    "q": ("\u051a\u051b", ""),  # Ԛ ԛ
    "s": ("\u0405\u0455", ""),  # Ѕ ѕ (dze)
    "t": ("\u0422\u0442", "\u03a4\u03c4"),  # Т т, Τ τ
    "u": ("", "\u03c5"),  # υ (small upsilon)
    "v": ("\u0474\u0475", "\u03bd"),  # Ѵ ѵ (izhitsa), ν (small nu)
    "w": ("\u051c\u051d\u0461", "\u03c9"),  # Ԝ ԝ, ѡ (small omega), ω
    "x": ("\u0425\u0445", "\u03a7\u03c7"),  # Х х, Χ χ
    "y": ("\u0423\u0443\u04ae\u04af", "\u03a5\u03b3"),  # У у, Ү ү (straight u), Υ, γ (small gamma)
    "z": ("", "\u0396"),  # Ζ
}
# Dashes and colons that look like ASCII's (after confusables.txt too), each read as it: an original-protocol team is
# known by its name's prefix ("tcp-json:<host>"), and with U+2010 for its hyphen a stranger's name passed for one
PUNCTUATION_LOOKALIKES = {
    "-": "\u2010\u2011\u2012\u2013\u2043\u02d7\u2212\u2796",  # hyphens, figure and en dash, minus signs
    ":": "\u02d0\u0589\u05c3\u2236\ua789",  # modifier letter colons, Armenian full stop, sof pasuq, ratio
}
_AS_LATIN = str.maketrans({c: latin for latin, scripts in LATIN_LOOKALIKES.items() for c in "".join(scripts)}
                          | {c: ascii_ for ascii_, forms in PUNCTUATION_LOOKALIKES.items() for c in forms})


def _reading(team: str, lookalikes: bool) -> str:
    text = unicodedata.normalize("NFKD", team)  # (first: a letter with an accent is the letter and its mark)
    if lookalikes:
        text = text.translate(_AS_LATIN)
    text = unicodedata.normalize("NFKD", text.casefold())
    return "".join(c for c in text if not (c.isspace() or c in _BLANKS or unicodedata.category(c).startswith("M")))


def looks(team: str) -> str:
    """What a team name reads as on the leaderboard: compatibility forms (fullwidth letters), Cyrillic and Greek
    look-alikes of Latin letters (LATIN_LOOKALIKES) and case folded, without the marks on its letters, its spaces
    (the page collapses them) or characters that print nothing."""
    return _reading(team, lookalikes=True)


def name_problem(team: str, teams) -> tuple[str, str] | None:
    """("bad_team", details) for a new team's name that shows nothing on the leaderboard, stacks marks over its
    neighbours' rows, or reads as the name of one of `teams` does (with look-alikes folded, or case alone); else
    None."""
    seen, cased = looks(team), _reading(team, lookalikes=False)
    if not seen:
        return ("bad_team", f"team name {team!r} shows nothing on the leaderboard: choose another --team")
    marks = 0
    for c in unicodedata.normalize("NFD", team):
        marks = marks + 1 if unicodedata.category(c) in ("Mn", "Me") else 0
        if marks > MAX_MARKS:
            return ("bad_team", f"team name {team[:16]!r}... stacks over {MAX_MARKS} marks on one character: choose "
                                f"another --team")
    for other in teams:
        if looks(other) == seen or _reading(other, lookalikes=False) == cased:
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
