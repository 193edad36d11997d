"""The automatic supersession rule: does a new fact replace an older one?

The store calls :func:`decide` for each older live fact about the same
subject(s) (same owner scope) that the new fact's embedding is close to;
``similarity`` is the cosine between the two embeddings.  A ``conflict``
decision means the older fact gets ``superseded_at``/``superseded_by``; it is
never deleted.  Explicit supersession (``correct``) does not go through here.

Why not the spec's rule (cosine >= 0.75)?  On the labelled pairs in
``tests/data/supersession_pairs.jsonl`` refinements and additions ("Sarah
likes tea" / "Sarah likes green tea": cosine 0.90) are as close as genuine
value changes, so a cosine threshold alone supersedes true facts; and a wrong
supersession hides a true fact, so this rule is chosen precision first (see
``tools/eval_supersession.py`` and the README for the figures).

The rule, on normalised, stemmed token sequences (contractions expanded,
"now"/"anymore"/... kept aside as markers):

1. below ``GATE`` similarity: never a conflict (different topics);
2. one side negated and the other not ("likes coffee" / "does not like coffee",
   "stopped", "gave up", "no longer", "cancelled"): conflict (negation flip);
3. an addition marker ("also", "too", "another"): compatible;
4. otherwise the two sentences are aligned on their common prefix and suffix;
   what differs is the value.  One value empty, or one contained in the other:
   compatible (refinement).  The difference starts inside the predicate (a
   different verb, or "works at" / "works as"): compatible (different slot);
5. same predicate, different value: conflict when the slot holds one value
   (possessive "X's favorite drink is", "is called", "lives in", "works at",
   "born", "married to", a time or place after "is"/"at"), when both values
   are quantities, or when the new fact says it changed ("now", "instead",
   "moved"); compatible for many-valued predicates ("likes", "has", "plays").

Limits: English only; paraphrases with no shared predicate ("lives in Paris"
/ "has settled in Rome") are missed unless listed in ``_CANONICAL``; a
negation that does not flip the same statement ("doesn't like tea" / "likes
coffee") is only caught through the similarity gate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import snowballstemmer

#: Below this cosine two facts are about different things (chosen on the
#: labelled pairs with tools/eval_supersession.py, precision first).
GATE = 0.70

_STEM = snowballstemmer.stemmer("english")

_CONTRACTIONS = {
    "n't": " not", "'re": " are", "'m": " am", "'ve": " have", "'ll": " will", "'d": " would",
}
_IRREGULAR = {"can't": "can not", "won't": "will not", "cannot": "can not"}
# Whole phrases rewritten before tokenising, so that paraphrases share a predicate.
_CANONICAL = (
    (r"\b(?:has |have )?moved to\b", "lives in"),
    (r"\bis living in\b", "lives in"),
    (r"\bworks for\b", "works at"),
    (r"\bis employed (?:at|by)\b", "works at"),
    (r"\bgoes by\b", "is called"),
    (r"\bfavourite\b", "favorite"),
    (r"\bas well\b", "too"),
)
_NEGATION_PHRASES = (
    r"\bno longer\b", r"\bnot any ?more\b", r"\bstopped\b", r"\bgave up\b", r"\bgiven up\b", r"\bquit\b",
    r"\bcancel+ed\b", r"\bnever\b", r"\bnot\b", r"\bno\b",
)
_CHANGE = frozenset({"now", "anymore", "instead", "currently", "nowadays", "switched", "changed", "new"})
_ADDITION = frozenset({"also", "too", "another", "additionally"})
_FILLER = frozenset({"still", "really", "actually", "just", "especially"})
_AUX = frozenset({"do", "does", "did", "doe"})
_COPULA = frozenset({"is", "are", "was", "were", "be"})
_PREPOSITIONS = frozenset({"at", "as", "in", "on", "for", "to", "from", "with", "under", "by", "near", "into"})
_LOCATIVE = frozenset({"at", "in", "on", "under", "near", "behind", "by", "inside", "outsid", "abov", "below", "besid",
                       "next", "upstair", "downstair", "home", "away"})
_ARTICLES = frozenset({"a", "an", "the", "some", "of"})
_HAVE = {"has": "have", "had": "have", "having": "have"}
# Predicates (stems) that hold one value at a time for a given subject.
_SINGLE = frozenset({"live", "work", "born", "marri", "call", "name", "favorit", "prefer", "wake", "start",
                     "address", "password", "birthday", "age", "want"})
# Predicates (stems) that commonly hold many values.
_MULTI = frozenset({"like", "love", "enjoy", "hate", "have", "play", "speak", "eat", "drink", "read", "visit",
                    "collect", "allerg", "follow", "support", "take", "own", "watch", "cook", "celebr"})
_NUMBER_WORDS = frozenset({"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                           "eleven", "twelve", "twice", "once", "thrice", "first", "second", "third", "fourth",
                           "fifth", "half", "dozen"})
_CLOCK_WORDS = frozenset({"am", "pm", "noon", "midnight", "morn", "even", "night"})
# Calendar words: under a many-valued predicate ("has yoga on Mondays") a new day adds, not replaces.
_CALENDAR_WORDS = frozenset({"monday", "tuesday", "wednesday", "thursday", "friday",
                         "saturday", "sunday", "januari", "februari", "march", "april",
                         "may", "june", "juli", "august", "septemb", "octob", "novemb", "decemb", "week", "weekend"})


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether the new fact supersedes the old one, and why (for logs and history)."""

    conflict: bool
    reason: str


@dataclass(frozen=True, slots=True)
class _Parsed:
    tokens: tuple[str, ...]
    negated: bool
    change: bool
    addition: bool


def decide(new_text: str, old_text: str, similarity: float, gate: float = GATE) -> Decision:
    """Decide whether ``new_text`` supersedes ``old_text`` (both about the same subjects).

    ``similarity`` is the cosine of their embeddings (pass 1.0 in lexical-only
    mode to rely on the token rule alone).  Pure and deterministic; never raises
    for any strings.
    """
    if similarity < gate:
        return Decision(False, f"similarity {similarity:.2f} below gate {gate:.2f}")
    new, old = _parse(new_text), _parse(old_text)
    if new.negated != old.negated:
        return Decision(True, "negation flip")
    if new.addition:
        return Decision(False, "addition")
    return _compare_values(new, old)


def _compare_values(new: _Parsed, old: _Parsed) -> Decision:
    prefix, old_value, new_value = _align(old.tokens, new.tokens)
    if not old_value or not new_value:
        return Decision(False, "refinement" if new_value else "same statement")
    old_content, new_content = _content(old_value), _content(new_value)
    if old_content <= new_content or new_content <= old_content:
        return Decision(False, "refinement")
    if not _has_predicate(prefix) or _differs_in_predicate(old_value, new_value):
        return Decision(False, "different predicate")
    return _value_change(prefix, old_value, new_value, new.change)


def _value_change(prefix: tuple[str, ...], old_value: tuple[str, ...], new_value: tuple[str, ...],
                  change_marker: bool) -> Decision:
    if change_marker:
        return Decision(True, "value changed (change marker)")
    if _is_count(old_value) and _is_count(new_value):
        return Decision(True, "quantity changed")
    if _single_valued(prefix):
        return Decision(True, "value of a single-valued slot changed")
    if any(tok in _MULTI for tok in prefix):
        return Decision(False, "many-valued predicate")
    if _is_when_or_where(prefix, old_value) and _is_when_or_where(prefix, new_value):
        return Decision(True, "place or time changed")
    return Decision(False, "no evidence of a single-valued slot")


def _align(old: tuple[str, ...], new: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(common prefix, old middle, new middle) after removing the common prefix and suffix."""
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    end = 0
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end]:
        end += 1
    return old[:start], old[start:len(old) - end], new[start:len(new) - end]


def _has_predicate(prefix: tuple[str, ...]) -> bool:
    # A verb, copula or possessive must be shared, otherwise the predicates differ.
    return any(tok in _COPULA or tok in _SINGLE or tok in _MULTI or tok == "'s" for tok in prefix) or \
        any(not _is_function_word(tok) for tok in prefix[1:])


def _differs_in_predicate(old_value: tuple[str, ...], new_value: tuple[str, ...]) -> bool:
    """"works at X" vs "works as Y", or a different verb: not the same slot."""
    first_old, first_new = old_value[0], new_value[0]
    if first_old in _LOCATIVE and first_new in _LOCATIVE:
        return False  # "under the doormat" / "in the mailbox": both say where
    if first_old in _PREPOSITIONS and first_new in _PREPOSITIONS:
        return first_old != first_new
    return first_old in _SINGLE | _MULTI or first_new in _SINGLE | _MULTI


def _single_valued(prefix: tuple[str, ...]) -> bool:
    if any(tok in _SINGLE for tok in prefix):
        return True
    # "X's <noun> is ...": a possessed attribute has one value ("Anna's office is on ...",
    # "Grandma's doctor is Dr Patel").
    return "'s" in prefix and any(tok in _COPULA for tok in prefix[prefix.index("'s"):])


def _is_when_or_where(prefix: tuple[str, ...], value: tuple[str, ...]) -> bool:
    # "The key is under the doormat", "Dinner is at 7 pm": a thing has one place and time.
    copula = any(tok in _COPULA for tok in prefix)
    return copula and (value[0] in _PREPOSITIONS | _LOCATIVE or prefix[-1] in _PREPOSITIONS or _is_when(value))


def _is_count(value: tuple[str, ...]) -> bool:
    """Numbers and clock times: a changed count or time replaces the old one."""
    return any(tok[0].isdigit() or tok in _NUMBER_WORDS or tok in _CLOCK_WORDS for tok in value)


def _is_when(value: tuple[str, ...]) -> bool:
    return _is_count(value) or any(tok in _CALENDAR_WORDS for tok in value)


def _content(value: tuple[str, ...]) -> frozenset[str]:
    # Content words only: "in May" -> "on May 3" adds a day, it does not change the month.
    return frozenset(tok for tok in value if tok not in _ARTICLES and tok not in _PREPOSITIONS)


def _is_function_word(tok: str) -> bool:
    return tok in {"the", "a", "an", "and", "of", "her", "his", "their", "my", "our", "user"} or tok in _PREPOSITIONS


@lru_cache(maxsize=4096)
def _parse(text: str) -> _Parsed:
    """Normalise, note negation/change/addition markers, stem the remaining tokens."""
    text = _expand(text.lower().replace("’", "'"))
    for pattern, replacement in _CANONICAL:
        text = re.sub(pattern, replacement, text)
    negated = False
    for pattern in _NEGATION_PHRASES:
        text, count = re.subn(pattern, " ", text)
        negated = negated or count > 0
    words = re.findall(r"'s\b|[a-z0-9]+(?:[:.][0-9]+)?", text)
    change = any(w in _CHANGE for w in words)
    addition = any(w in _ADDITION for w in words)
    kept = [w for w in words if w not in _CHANGE | _ADDITION | _FILLER | _AUX]
    return _Parsed(tuple(_stem(w) for w in kept), negated, change, addition)


def _expand(text: str) -> str:
    for word, full in _IRREGULAR.items():
        text = text.replace(word, full)
    for suffix, full in _CONTRACTIONS.items():
        text = text.replace(suffix, full)
    return text


def _stem(word: str) -> str:
    if word == "'s" or word[0].isdigit():
        return word
    return _HAVE.get(word) or _STEM.stemWord(word)
