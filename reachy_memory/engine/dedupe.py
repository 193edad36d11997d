"""The restatement rule: is a new fact the same as one already kept?

Pure functions over texts and one cosine; the store finds the candidates (the new
memory's nearest neighbours of the same type and owner) and decides nothing else.
Two memories are the same when:

1. **their normalized texts are equal** (:func:`normalized`): case (but for codes),
   whitespace and punctuation aside, contractions expanded ("doesn't" / "does not"),
   numbers in words or digits ("two" / "2"), dates either way round ("on 14 October" /
   "October 14"), British or American spelling, "works as a" / "is a", "has a nut
   allergy" / "is allergic to nut", "the dog's name is" / "the dog is called", two words
   joined by a hyphen ("Wi-Fi" / "wifi"; not after a prefix: "re-cover"), "every day" /
   "daily", "6 a.m." / "6 am", and a leading filler dropped ("I know that ...",
   "Remember that ...", "FYI: ...", "Reachy, remember that ...");
2. or **they say it with the same content words in the same order** and words that
   carry no fact ("really", "usually", "kept", "the", "is") added or dropped, but the
   same "of", "for", "to" or "'s" before each word (:func:`_marked`: "Tom is the boss of
   Anna" is not "Tom's boss is Anna"), and the cosine of their embeddings is at least
   :data:`THRESHOLD`.  "The same order" allows moves that keep who does what to whom: a
   phrase moved from one end to the other ("Every evening Mia walks the dog",
   :func:`_rotation`), a compound turned around "for" or "to" or a person's relation
   around "of" ("the garage door code" / "the code for the garage door", "Lily's
   teacher" / "the teacher of Lily", :func:`_turned`), and the passive ("the light is
   controlled by the plug" / "the plug controls the light", :func:`_active`).

Everything a contrast changes is a content word: a negation ("not", "never", "no
longer"), a number or a time ("7 pm" / "8 pm", "Monday" / "Tuesday", "before" /
"after"), a name ("Sarah" / "Emma", "Google" / "Apple"), a relation ("my wife" /
"my sister"), an object or a quality ("tea" / "coffee", "left" / "right"). So two
facts differing in one of those are never the same, whatever their cosine: on the
labelled pairs (``tests/data/dedupe_pairs.jsonl``) "sleeps on the left side of the bed"
and "... the right side ..." have a cosine of 0.988, above most true paraphrases.
Synonyms are the price: "Sarah enjoys Italian food" restates "Sarah likes Italian
food" only through the short list :data:`_SYNONYMS`; other rewordings stay two
memories (search shows both; nothing is lost).

Codes keep their case: a word mixing letters and digits ("Blue42Sky", "sunFlower7")
is a password or a code, and "BLUE42SKY" is another one; the value of a password, a PIN
or a code is compared as written ("tiger!" is not "tiger?", "blue-sky" not "bluesky").
A symbol is a word ("👍" is not "❤️"), and so are "-18", "1/2" and "1-2".

The store adds what text cannot say: the same owner, type, sharing and subjects,
and a fact dated relative to its telling ("today", "tomorrow", "last week") is the
same only when told again within :data:`RELATIVE_SECONDS`.

The threshold was chosen with ``tools/eval_dedupe.py`` (chosen on one half of the
labelled pairs, reported on the other, both ways; precision first).
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import snowballstemmer

from reachy_memory.engine.filters import validate_metadata
from reachy_memory.engine.lexical_index import LexicalIndex
from reachy_memory.engine.records import Record
from reachy_memory.engine.state import GROUP, MemoryState
from reachy_memory.engine.vector_index import VectorIndex, nearest
from reachy_memory.errors import ValidationError
from reachy_memory.model import MemoryType, SearchResult, to_datetime, to_epoch

if TYPE_CHECKING:
    from reachy_memory.engine.ports import Engine

#: Rule 2's cosine floor (fp32 or int8 vectors of the configured model); see the module doc.
THRESHOLD = 0.88
#: A fact dated relative to its telling is only restated within this many seconds.
RELATIVE_SECONDS = 3600.0

_STEM = snowballstemmer.stemmer("english")
_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})
# "8:15", "3.5", "1,000", "1/2", "1-2" and "-18" stay one word
_WORD = re.compile(r"(?:(?<![\w-])-(?=[0-9]))?[^\W_]+(?:[.:,/-][0-9]+)*")
# A password or a code keeps its case: a word mixing letters and digits ("Blue42Sky"; "TikTok" is a name).
_CODE = re.compile(r"[^\W\d_]\d|\d[^\W\d_]")
_EXPANSIONS = {"can't": "can not", "cannot": "can not", "won't": "will not", "shan't": "shall not",
               "ain't": "is not", "n't": " not", "'re": " are", "'m": " am", "'ve": " have", "'ll": " will"}
_CONTRACTION = re.compile(r"\b(?:can't|cannot|won't|shan't|ain't)\b|n't\b|'re\b|'m\b|'ve\b|'ll\b",
                          re.IGNORECASE)
# Leading words that say "this is a fact" and add none: dropped, repeatedly.
_FILLERS = (
    r"(?:(?:i\s+know|i\s+remember|remember|please\s+remember|note|please\s+note|do\s+not\s+forget|"
    r"keep\s+in\s+mind|bear\s+in\s+mind|i\s+want\s+you\s+to\s+know|i\s+told\s+you|you\s+should\s+know)"
    r"\s+that\b|just\s+so\s+you\s+know\b|fyi\b|for\s+your\s+information\b|by\s+the\s+way\b|btw\b|"
    r"for\s+the\s+record\b|as\s+you\s+know\b|remember\s*:|note\s*:|reminder\s*:)")
# The robot addressed ("Reachy, remember that ..."), only before one of those: "Robot, Lego and ..." is a list.
_FILLER = re.compile(rf"^\s*(?:(?:hey\s+|ok\s+)?(?:reachy|robot)\s*[,:!]\s*(?={_FILLERS}))?{_FILLERS}[\s,:;.!-]*")
_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())} | {
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "first": "1st", "second": "2nd", "third": "3rd", "fourth": "4th", "fifth": "5th"}
_SPELLING = {"favourite": "favorite", "colour": "color", "colours": "colors", "neighbour": "neighbor",
             "neighbours": "neighbors", "grey": "gray", "centre": "center", "theatre": "theater",
             "practise": "practice", "practises": "practices", "organise": "organize", "mum": "mom",
             "pyjamas": "pajamas", "aeroplane": "airplane", "tyre": "tire", "tyres": "tires"}
# Words that mean the same in a household fact, as one (the content-word rule only).
_SYNONYMS = {"enjoy": "like", "fond": "like", "name": "call", "scare": "afraid", "frighten": "afraid",
             "talk": "speak", "normal": "usual"}
# Words no fact turns on: left out of the content words (rule 2 only; rule 1 keeps every word).
_LIGHT = frozenset("""
a an the is are am be being s of for to that this it do does
really usually normally generally typically actually just also too still currently now nowadays kept
please definitely indeed basically
""".split())
# A password, PIN or code given with letters or symbols ("the wifi password is tiger!"): its value verbatim.
_SECRET_WORD = re.compile(r"(?i)pass|pin\b|code\b")
_SECRET = re.compile(r"(?i)(\b(?:password|passcode|passphrase|pin|code)\s+(?:is\s+|:\s*))"
                     r"(?!\d+\.?(?:\s|$))(\S+)")  # digits alone are compared as numbers already
_NAME_IS = re.compile(r"\b(\w+)'s\s+name\s+is\s+")  # "the dog's name is Rex": "the dog is called Rex"
_WORKS_AS = re.compile(r"\s+works?\s+as\s+")  # "Kate works as a teacher": "Kate is a teacher"
_ALLERGY = re.compile(r"\s+(?:has|have)\s+an?\s+(\w+)\s+allergy\b")  # "a nut allergy": "allergic to nut"
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_DAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_DAY_MONTH = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTHS})\b")  # "14 October": "October 14"
_MONTH_OR_DAY = re.compile(rf"\b(?:{_MONTHS}|{_DAYS})")
_ON_DATE = re.compile(rf"\bon\s+(?=(?:the\s+)?(?:\d{{1,2}}(?:st|nd|rd|th)?\b|(?:{_MONTHS}|{_DAYS})s?\b))")
# Two words of letters joined by a hyphen are one ("Wi-Fi", "tool-box"), but after a prefix that changes the
# word ("re-cover" is not "recover", "co-op" not "coop"); a password's value is compared verbatim (_SECRET).
_HYPHEN = re.compile(r"(?<![\w\-@.])(?!(?:re|co|un|de|pre|non|multi|anti|pro)-)([^\W\d_]+)-([^\W\d_]+)"
                     r"(?![\w\-@]|\.\w)")  # not in an address ("anna-lee@gmail.com")
_AM_PM = re.compile(r"\b([ap])\.m\b\.?", re.IGNORECASE)  # "6 a.m." is "6 am"
_EVERY_ONE = {"day": "daily", "week": "weekly", "month": "monthly", "year": "yearly", "night": "nightly"}
_EVERY = re.compile(r"\b(?:every|each)\s+(day|week|month|year|night)\b")  # "every day": "daily"
_BE = frozenset({"is", "are", "am", "be", "being"})  # before a participle: the passive (:func:`_active`)
_PARTICLES = frozenset({"on", "off", "up", "down", "out", "in", "over", "away"})  # of a phrasal verb
# Content words (stemmed) that begin a phrase: where the agent of a passive ends ("by Dad | every month").
_PHRASE = frozenset(_STEM.stemWord(w) for w in """in on at after before during from with near under behind until
since around every each daily weekly monthly yearly nightly""".split())
_JOINS = frozenset({"for", "to"})  # what turns a compound around (:func:`_turned`)
_OF = frozenset({"of"})
_MARKS = _JOINS | _OF | {"s"}  # light words that say whose or for whom: kept with the word after them
# A person's relations: "Lily's teacher" is "the teacher of Lily" (:func:`_turned`).
_RELATIONS = frozenset((_STEM.stemWord(w),) for w in """mother father mom dad parent sister brother son daughter
wife husband partner friend boss teacher doctor dentist nurse coach aunt uncle cousin niece nephew grandmother
grandfather grandma grandpa neighbor godmother godfather babysitter colleague""".split())
# Participles after which "by" says where, not who: "Tom is seated by Anna" (beside her).
_PLACED = frozenset(_STEM.stemWord(w) for w in """seated sat parked placed located kept left put hung hanging standing
stood situated lying sitting stored""".split())
_AGENT_GAP = frozenset({"the", "of", "s"})  # what a passive's agent may hold between its words
#: Texts with more content words than this are only the same in the same order or rotated.
MOVES_WORDS = 64
_NEGATION = frozenset({"not", "no", "never", "nobody", "nothing", "none", "neither", "nor", "without"})
_RELATIVE = frozenset({"today", "tomorrow", "yesterday", "tonight", "ago", "recently", "lately", "soon"})
_RELATIVE_PHRASE = re.compile(r"\b(?:this|next|last)\s+(?:morning|afternoon|evening|night|week|weekend|month|year|"
                              r"monday|tuesday|wednesday|thursday|friday|saturday|sunday|time)\b")


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether two memories are the same, and why (for the dedupe report and logs)."""

    same: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Text:
    """One memory's text as the rule reads it: :func:`normalized` and the content words."""

    normalized: str
    content: tuple[str, ...]
    relative: bool  # dated relative to its telling ("tomorrow")
    gaps: tuple[tuple[str, ...], ...] = ()  # the light words before each content word
    marks: tuple[str, ...] = ()  # of those, the ones saying whose or for whom ("of", "for", "to", "s")
    turnable: bool = True  # no passive turned active: it may take part in :func:`_turned`

CACHED_CHARS = 1000  # texts up to this long are cached (a write reads its neighbours' texts again and again)


def read(text: str) -> Text:
    """``text`` as the rule reads it (:func:`normalized`, content words, relative dating)."""
    return _read_cached(text) if len(text) <= CACHED_CHARS else _read(text)


@lru_cache(maxsize=1024)
def _read_cached(text: str) -> Text:
    return _read(text)


def _read(text: str) -> Text:
    words = _words(text)
    norm = " ".join(words)
    content, gaps = _content(words)
    active = _active(content, gaps)
    if active is not None:
        content, gaps = active
    relative = any(w in _RELATIVE for w in words) or _RELATIVE_PHRASE.search(norm) is not None
    marks = tuple("+".join(sorted(_MARKS.intersection(gap))) for gap in gaps)
    return Text(norm, content, relative, gaps, marks, active is None)


def _content(words: list[str]) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The content words of ``words`` (stemmed, one synonym each) and, for each, the light
    words between it and the content word before it."""
    content: list[str] = []
    gaps: list[tuple[str, ...]] = []
    gap: list[str] = []
    for word in words:
        if word in _LIGHT:
            gap.append(word)
            continue
        stem = _stem(word)
        content.append(_SYNONYMS.get(stem, stem))
        # "likes watching" is "likes to watch": a word in -ing right after another carries the "to"
        gaps.append(tuple(gap) if gap or not content[1:] or len(word) < 6 or not word.endswith("ing") else ("to",))
        gap = []
    return tuple(content), tuple(gaps)


def _active(content: tuple[str, ...],
            gaps: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]] | None:
    """A passive sentence turned active, or None: "the light is controlled by the plug"
    reads as "the plug controls the light" (P *is* V [particle] *by* Q R -> Q V P R).  Q, the
    agent, runs from "by" up to the next light word other than "the", "of" and a possessive
    ("by Tom's mother", "by the son of Anna") or a word that begins a phrase ("every",
    "in", "at"...).  "By" before a date, a day or a number is a deadline ("by Tuesday"), not
    an agent."""
    if "by" not in content:
        return None
    by = content.index("by")
    verb = by - 2 if by >= 3 and content[by - 1] in _PARTICLES else by - 1  # "switched on by"
    if verb < 1 or by + 1 >= len(content) or not _BE.intersection(gaps[verb]) or _when(content[by + 1]) \
            or content[verb] in _PLACED:
        return None
    end = next((i for i in range(by + 2, len(content)) if set(gaps[i]) - _AGENT_GAP or content[i] in _PHRASE),
               len(content))
    agent_gaps = ((), *gaps[by + 2:end])
    return (content[by + 1:end] + content[verb:by] + content[:verb] + content[end:],
            agent_gaps + ((),) * (by - verb) + gaps[:verb] + gaps[end:])


def _when(word: str) -> bool:
    """Whether ``word`` (a content word) is a date, a day, a time or a number."""
    return any(c.isdigit() for c in word) or word in _RELATIVE or _MONTH_OR_DAY.match(word) is not None


def normalized(text: str) -> str:
    """``text`` with case (but for codes), whitespace, punctuation, contractions, number
    words, spelling variants and a leading filler ("I know that") made uniform: two texts
    with equal ``normalized`` say the same thing in the same words.  (No stemming: what a
    search's collapse of copies reads, cheaper than :func:`read`.)"""
    return _normalized_cached(text) if len(text) <= CACHED_CHARS else " ".join(_words(text))


@lru_cache(maxsize=2048)
def _normalized_cached(text: str) -> str:
    return " ".join(_words(text))


def decide(new_text: str, old_text: str, similarity: float | None, threshold: float = THRESHOLD) -> Decision:
    """Whether ``new_text`` restates ``old_text`` (the caller checked owner, type and
    subjects).  ``similarity``: the cosine of their embeddings, None without a model
    (then only equal normalized texts are the same).  Pure; never raises for strings."""
    new, old = read(new_text), read(old_text)
    if new.normalized == old.normalized:
        return Decision(True, "the same text (normalized)")
    if _negated(new.content) != _negated(old.content):
        return Decision(False, "negation differs")
    if _numbers(new.content) != _numbers(old.content):
        return Decision(False, "numbers differ")
    if sorted(new.content) != sorted(old.content):
        return Decision(False, "words differ")
    if not (_rotation(_marked(new), _marked(old)) or _turned(new, old) or _turned(old, new)):
        return Decision(False, "word order or whose/for whom differs")
    if similarity is None:
        return Decision(False, "no embedding to compare")
    if not similarity >= threshold:  # NaN refuses too
        return Decision(False, f"cosine {similarity:.3f} below {threshold:.2f}")
    return Decision(True, f"the same words, cosine {similarity:.3f}")


def _words(text: str) -> list[str]:
    """The words of ``text``: NFKC, case folded but for codes, contractions expanded,
    a leading filler dropped, number words as digits, one spelling."""
    text = unicodedata.normalize("NFKC", text).translate(_QUOTES)
    if _SECRET_WORD.search(text) is not None:
        text = _SECRET.sub(_secret, text)
    if "-" in text:
        text = _HYPHEN.sub(r"\1\2", text)
    if ".m" in text or ".M" in text:
        text = _AM_PM.sub(r"\1m", text)
    if not text.isascii():  # a symbol is a word: "👍" is not "❤️"
        text = "".join(f" sym{ord(c):x} " if unicodedata.category(c)[0] == "S" else c for c in text)
    if _CODE.search(text) is None:
        folded = text.casefold()
    else:
        folded = " ".join(w if _CODE.search(w) else w.casefold() for w in text.split())
    if "'" in folded or "cannot" in folded:
        folded = _CONTRACTION.sub(lambda m: _EXPANSIONS[m.group().casefold()], folded)
    while (filler := _FILLER.match(folded)) is not None and filler.end() > 0:
        folded = folded[filler.end():]
    if " as " in folded:
        folded = _WORKS_AS.sub(" is ", folded)
    if " name is " in folded:
        folded = _NAME_IS.sub(r"\1 is called ", folded)
    if "allergy" in folded:
        folded = _ALLERGY.sub(r" is allergic to \1", folded)
    if "every " in folded or "each " in folded:
        folded = _EVERY.sub(lambda m: _EVERY_ONE[m.group(1)], folded)
    if _MONTH_OR_DAY.search(folded):
        folded = _DAY_MONTH.sub(r"\2 \1", _ON_DATE.sub("", folded))
    return [_NUMBERS.get(w) or _SPELLING.get(w) or w for w in _WORD.findall(folded)]


def _secret(match: re.Match[str]) -> str:
    """A password's value as one word that keeps its case and punctuation ("tiger!" is not
    "tiger?"), a sentence's last full stop aside."""
    value = match.group(2).removesuffix(".")
    return f"{match.group(1)}code{value.encode().hex()}"


@lru_cache(maxsize=8192)
def _stem(word: str) -> str:
    return word if word[0].isdigit() or not word.islower() else _STEM.stemWord(word)


def _negated(content: tuple[str, ...]) -> bool:
    return sum(w in _NEGATION for w in content) % 2 == 1


def _numbers(content: tuple[str, ...]) -> list[str]:
    return sorted(w for w in content if any(c.isdigit() for c in w))


def _rotation(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """``a`` is ``b`` with a run of words moved from its end to its front (or ``b`` itself);
    two words swapped are another statement ("the car is Tom's" / "Tom is the car's").
    Linear: ``a`` found in ``b`` twice over."""
    if len(a) != len(b):
        return False
    if len(b) < 3:
        return a == b
    return f"\0{chr(0).join(a)}\0" in f"\0{chr(0).join(b + b)}\0"


def _marked(text: Text) -> tuple[str, ...]:
    """The content words, each with the light words before it that say whose or for whom:
    "Tom is the boss of Anna" is not "Tom's boss is Anna", "afraid of" is not "afraid for"."""
    return tuple(f"{word} {mark}" for word, mark in zip(text.content, text.marks, strict=True))


def _turned(a: Text, b: Text) -> bool:
    """``b`` is ``a`` with one compound turned around "for" or "to": "the garage door code" /
    "the code for the garage door", "lactose intolerant" / "intolerant to lactose"; or a
    person's relation around "of": "Lily's teacher" / "the teacher of Lily".  In ``a`` the
    two parts stand side by side (nothing between them, or the relation's possessive), in
    ``b`` the preposition stands between them; within each part nothing but a possessive;
    everything else (words, and whose/for whom) is the same.  Not a compound around "of"
    ("a glass of wine" is not "a wine glass") nor another possessive ("Grandma's painting"
    is not "the painting of Grandma", "Anna's letter" not "the letter to Anna").
    Refused: a part holding a number ("the number 5 bus" / "the bus to number 5"), "to"
    just before the parts (an infinitive: "wants to visit Grandma" / "wants Grandma to
    visit"), a possessive just after them (a chain), and texts of more than
    :data:`MOVES_WORDS` content words (the check is quadratic)."""
    x, y = a.content, b.content
    if len(x) != len(y) or x == y or len(x) > MOVES_WORDS or not (a.turnable and b.turnable):
        return False
    start = next(i for i in range(len(x)) if x[i] != y[i])
    end = len(x) - next(i for i in range(len(x)) if x[-1 - i] != y[-1 - i])
    if a.marks[:start] != b.marks[:start] or a.marks[end:] != b.marks[end:] or "to" in a.marks[start] \
            or "to" in b.marks[start] or (end < len(x) and "s" in a.marks[end] + b.marks[end]) \
            or any(_when(word) for word in x[start:end]):
        return False
    for cut in range(start + 1, end):
        moved = start + end - cut  # where ``a``'s first part begins in ``b``
        joins = _JOINS if not a.gaps[cut] else _OF if a.gaps[cut] == ("s",) and x[cut:end] in _RELATIONS else None
        if joins and y[start:end] == x[cut:end] + x[start:cut] and joins.intersection(b.gaps[moved]) \
                and _compounds(a, start, cut, end) and _compounds(b, start, moved, end):
            return True
    return False


def _compounds(text: Text, start: int, cut: int, end: int) -> bool:
    """Whether the words ``[start:cut]`` and ``[cut:end]`` of ``text`` are each one phrase:
    nothing but a possessive between their words ("Grandma's hearing aid")."""
    return all(text.gaps[i] in ((), ("s",)) for i in range(start + 1, end) if i != cut)


def relative(text: str) -> bool:
    """Whether ``text`` is dated relative to its telling ("tomorrow", "last week")."""
    return read(text).relative


# -- the store's side: which memories may be the same, the refresh, the read-side collapse ---------

#: The memory types a write may merge into a kept memory (conversation turns are events: all kept).
KINDS = frozenset({MemoryType.FACT.value, MemoryType.CONTEXT.value})
#: How many nearest memories of the type a write compares itself with (hnswlib, or the exact scan);
#: when all are close and none is the same (other users' copies), 4x more, up to MAX_NEIGHBOURS.
NEIGHBOURS = 8
MAX_NEIGHBOURS = 128
#: Without a vector: the memories holding a write's rarest word are compared with it when there
#: are at most this many, else this many of those whose words cover the most of the write's.
WORDED = 32
#: Neighbours less similar than this are not read: two texts equal once normalized had a
#: cosine of 0.80 at least (a filler before a three-word fact), rule 2 needs THRESHOLD.
FLOOR = 0.6
#: The hnswlib search breadth of that query: a near-identical vector is found with a small one.
NEIGHBOUR_EF = 32
COUNT_KEY = "confirmations"  # metadata of a kept memory: how many times it was told again
TIME_KEY = "confirmed_at"  # and when it was told last (ISO 8601, UTC)
_IDENTITY_KEYS = ("context_key",)  # set_context's key: its memories are replaced by key, never merged


def mergeable(rec: Record) -> bool:
    """Whether ``rec`` may take part in a merge: a fact or a context memory that is no
    named note, archive or ``set_context`` value."""
    return (rec.type in KINDS and rec.name is None and rec.covers_until is None
            and not any(key in rec.metadata for key in _IDENTITY_KEYS))


def compatible(kept: Record, new: Record, entity_keys: Sequence[str]) -> bool:
    """Whether ``kept`` and ``new`` could be the same memory whatever their texts: both
    mergeable, ``kept`` live (not superseded), the same type, owner, sharing, subjects,
    expiry (none for a fact; a context memory's day), and the same person or speaker in
    their metadata (``search.entity_fields``)."""
    return (mergeable(kept) and mergeable(new) and not kept.hidden and kept.type == new.type
            and kept.owner == new.owner and kept.shared == new.shared and kept.expires == new.expires
            and set(kept.subjects) == set(new.subjects)
            and all(_entity(kept.metadata.get(k)) == _entity(new.metadata.get(k)) for k in entity_keys))


def same(kept: Record, new: Record, similarity: float | None, entity_keys: Sequence[str]) -> Decision:
    """Whether ``new`` restates ``kept`` (:func:`compatible`, then :func:`decide`); a fact
    dated relative to its telling is the same only within :data:`RELATIVE_SECONDS` of
    the last time ``kept`` was told."""
    if not compatible(kept, new, entity_keys):
        return Decision(False, "another owner, type, person or kind of memory")
    decision = decide(new.content, kept.content, similarity)
    if decision.same and (relative(new.content) or relative(kept.content)) \
            and abs(new.created - last_told(kept)) > RELATIVE_SECONDS:
        return Decision(False, "dated relative to its telling, told at another time")
    return decision


def restatement(new: Record, vector: np.ndarray | None, vectors: VectorIndex, by_slot: Mapping[int, Record],
                entity_keys: Sequence[str], now: float) -> tuple[Record, str] | None:
    """The kept memory ``new`` restates and why, among the :data:`NEIGHBOURS` nearest
    memories of its type (:func:`.vector_index.nearest`: its hnswlib graph and the vectors
    waiting for it, or the type's rows in a small store); None when there is none or
    ``new`` has no vector (lexical-only: a write is never merged)."""
    if vector is None or not mergeable(new) or vectors.count == 0:
        return None
    k = NEIGHBOURS
    while True:
        slots, sims = nearest(vectors, vector, k, GROUP[new.type], ef=max(NEIGHBOUR_EF, k))
        for slot, sim in zip(slots.tolist(), sims.tolist(), strict=True):
            kept = by_slot.get(slot)
            if sim >= FLOOR and kept is not None and not kept.expired(now):
                decision = same(kept, new, sim, entity_keys)
                if decision.same:
                    return kept, decision.reason
        # All k close but none the same (other users' or persons' copies of the sentence): look further.
        if len(slots) < k or sims[-1] < FLOOR or k >= MAX_NEIGHBOURS:
            return None
        k *= 4


def worded_restatement(new: Record, lexical: LexicalIndex, by_slot: Mapping[int, Record],
                       entity_keys: Sequence[str], now: float, b: float) -> tuple[Record, str] | None:
    """:func:`restatement` for a write without a vector (lexical-only mode, or the model
    failed): the same text once normalized (rule 1 only), among the memories holding the
    rarest of its words that normalizing keeps (a memory of the same normalized text
    holds it too), or when even that word is common, the memories whose words cover the
    most of its own (one BM25 query; the first 16 x :data:`WORDED`)."""
    if not mergeable(new):
        return None
    terms = set(lexical.tokenizer.terms(new.content)) & set(lexical.tokenizer.terms(normalized(new.content)))
    if not terms:
        return None
    held = {term: lexical.held_by(term) for term in terms}
    rarest = min(terms, key=lambda term: (held[term], term))
    if held[rarest] <= WORDED:
        slots = lexical.holders(rarest)
    else:  # the best covering first; another owner's or type's are passed over without reading them
        found, relevance = lexical.scores(new.content, None, b)
        slots = found[np.argsort(-relevance, kind="stable")[:WORDED * 16]]
    for slot in slots.tolist():
        kept = by_slot.get(slot)
        if kept is not None and not kept.expired(now):
            decision = same(kept, new, None, entity_keys)
            if decision.same:
                return kept, decision.reason
    return None


#: Bits of :class:`Told` (1 MB).  Two bits a key: at 66k fact and context memories (a 100k store) a
#: write of new words is taken for a possible copy once in ~4,000.
TOLD_BITS = 1 << 23
#: A store holding up to this many memories builds :class:`Told` as it opens (~5 ms); a bigger one at idle time.
TOLD_AT_OPEN = 256


class Told:
    """The content words (and type) of every kept fact and context memory, as a Bloom
    filter: a write whose own are not there restates none of them, since both ways of
    being the same need the same content words (:func:`_words_key`), so its check skips
    the vector search (an hnswlib query and the cache lines it evicts: most of the
    check's cost on a big store).  Complete once :meth:`build` (idle time) has added the
    memories kept when it began, each memory put meanwhile or since being added as it is
    put (:meth:`add`, from the state; a memory's text and type never change).  Until then
    :meth:`may_hold` says yes (the check searches, as without it).  Deleted memories stay
    in it: a later write of their words is searched for nothing.  Engine thread."""

    def __init__(self) -> None:
        self._bits = np.zeros(TOLD_BITS // 8, np.uint8)
        self._todo: list[Record] | None = None  # the memories kept when the build began
        self._done = 0  # of those, how many are added
        self.complete = False

    def add(self, rec: Record) -> None:
        """Hold ``rec``'s key (a fact or context memory's; others are never merged)."""
        if rec.type in KINDS:
            for bit in _told_bits(rec):
                self._bits[bit >> 3] |= 1 << (bit & 7)

    def may_hold(self, rec: Record) -> bool:
        """False only when no memory kept has ``rec``'s type and content words."""
        return not self.complete or all(self._bits[bit >> 3] >> (bit & 7) & 1 for bit in _told_bits(rec))

    def build(self, records: Iterable[Record], budget: int) -> int:
        """Add up to ``budget`` of the memories kept when the build began (``records``,
        read at the first call); returns how many (0: complete)."""
        if self.complete:
            return 0
        if self._todo is None:
            self._todo = [rec for rec in records if rec.type in KINDS]
        step = self._todo[self._done : self._done + budget]
        for rec in step:
            self.add(rec)
        self._done += len(step)
        if self._done >= len(self._todo):
            self._todo, self.complete = None, True
        return max(len(step), 1)


def _told_bits(rec: Record) -> tuple[int, int]:
    """Two bits of :class:`Told` for ``rec``'s type and content words (any order)."""
    key = hash((rec.type, tuple(sorted(read(rec.content).content))))
    return key & (TOLD_BITS - 1), (key >> 32) & (TOLD_BITS - 1)


@dataclass(frozen=True)
class Limits:
    """What a write's check reads of the configuration."""

    entity_keys: tuple[str, ...]  # search.entity_fields: metadata naming who a memory is about
    max_bytes: int  # memory.max_metadata_bytes
    max_keys: int  # memory.max_metadata_keys
    bm25_b: float  # search.bm25_b: the check without a vector is one BM25 query


def fold(puts: list[list[Any]], ids: list[str], state: MemoryState, limits: Limits,
         now: float, words: Told | None = None) -> tuple[list[list[Any]], list[list[Any]]]:
    """A write's ``put`` ops without the restatements: (the puts kept, the ``update`` ops
    refreshing the memories they restate).  A put restates a kept memory
    (:func:`restatement`, or :func:`worded_restatement` without a vector) or one put before
    it in the same write; ``ids`` (the write's answer, an id per item) then names the
    memory kept instead.  Conversation turns and other memories :func:`mergeable` refuses
    pass unchanged.  With ``words`` (:class:`Told`), a put whose content words no kept
    memory has is not searched for.  Engine thread, under the lock."""
    kept_puts: list[list[Any]] = []
    # this write's puts that may be restated, by their content words (only those can be the same)
    seen: dict[tuple[Any, ...], list[tuple[Record, np.ndarray | None, list[Any]]]] = {}
    told: dict[str, tuple[Record, dict[str, Any], int, float]] = {}  # kept id -> (record, metadata, times, last)
    renamed: dict[str, str] = {}  # a restatement's id -> the memory kept for it
    for op in puts:
        new = Record(**op[1])
        vector = np.frombuffer(op[2], np.float32) if op[2] is not None else None
        if not mergeable(new):
            kept_puts.append(op)
            continue
        bucket = seen.setdefault(_words_key(new), []) if len(puts) > 1 else []  # one write: nothing before it
        earlier = next((put for rec, vec, put in bucket
                        if same(rec, new, _dot(vec, vector), limits.entity_keys).same), None)
        found = None
        if earlier is None and vector is not None:
            if words is None or words.may_hold(new):
                found = restatement(new, vector, state.vectors, state.by_slot, limits.entity_keys, now)
        elif earlier is None:
            found = worded_restatement(new, state.lexical, state.by_slot, limits.entity_keys, now, limits.bm25_b)
        if earlier is not None:
            earlier[1] = _told_again(earlier[1], new, limits)
            renamed[new.id] = earlier[1]["id"]
        elif found is not None:
            kept = found[0]
            _, metadata, times, at = told.get(kept.id, (kept, {}, 0, new.created))
            told[kept.id] = (kept, metadata | new.metadata, times + 1, max(at, new.created))
            renamed[new.id] = kept.id
        else:
            kept_puts.append(op)
            bucket.append((new, vector, op))
    updates = [["update", kept.id, refreshed(kept, metadata, at, told=times, max_bytes=limits.max_bytes,
                                             max_keys=limits.max_keys)]
               for kept, metadata, times, at in told.values()]
    ids[:] = [renamed.get(memory_id, memory_id) for memory_id in ids]
    return kept_puts, updates


def _told_again(row: dict[str, Any], new: Record, limits: Limits) -> dict[str, Any]:
    """``row`` (a put of this write) refreshed by ``new``, a restatement of it in the same write."""
    rec = Record(**row)
    fields = refreshed(rec, new.metadata, new.created, max_bytes=limits.max_bytes, max_keys=limits.max_keys)
    return row | {"metadata": fields["metadata"]}


def _words_key(rec: Record) -> tuple[Any, ...]:
    """What two memories that may be the same share: type, owner and content words (any order)."""
    return rec.type, rec.owner, tuple(sorted(read(rec.content).content))


def _dot(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    return float(a @ b) if a is not None and b is not None else None


def refreshed(kept: Record, metadata: Mapping[str, Any], at: float, *, told: int = 1,
              max_bytes: int, max_keys: int) -> dict[str, Any]:
    """The fields of an ``update`` op refreshing ``kept``, told ``told`` more times (the
    last at ``at``), with ``metadata`` merged over its own (the newer value wins): its
    metadata (with :data:`COUNT_KEY` and :data:`TIME_KEY`) and its decay clock.  Metadata
    over the limits keeps the kept memory's own, with the count and time when they fit."""
    marks = {COUNT_KEY: _count(kept) + told, TIME_KEY: to_datetime(at).isoformat()}
    for candidate in ({**kept.metadata, **metadata, **marks}, {**kept.metadata, **marks}):
        try:
            merged = validate_metadata(candidate, max_bytes=max_bytes, max_keys=max_keys)
            break
        except ValidationError:  # TooLargeError too
            continue
    else:
        merged = dict(kept.metadata)
    return {"metadata": merged, "last_access": max(at, kept.last_access or kept.created), "confidence": 1.0}


def last_told(rec: Record) -> float:
    """When ``rec`` was told last: its :data:`TIME_KEY`, else its creation."""
    value = rec.metadata.get(TIME_KEY)
    if isinstance(value, str):
        try:
            return max(rec.created, to_epoch(datetime.fromisoformat(value)) or rec.created)
        except ValueError:
            pass
    return rec.created


def collapse_key(content: str, memory_type: str) -> str | None:
    """What two search hits share when they show the same thing: the normalized text of a
    fact or context memory; None for a conversation turn (an event: "ok" twice is two)."""
    return normalized(content) if memory_type in KINDS else None


def unique_hits(hits: Sequence[SearchResult]) -> list[SearchResult]:
    """``hits`` with one for each normalized text of a fact or context memory (the
    first: the caller's best), as a search shows them (``context_for`` joins two)."""
    shown: set[str] = set()
    out = []
    for hit in hits:
        key = collapse_key(hit.memory.content, hit.memory.memory_type.value)
        if key is None or key not in shown:
            out.append(hit)
        if key is not None:
            shown.add(key)
    return out


def _entity(value: Any) -> Any:
    return " ".join(value.casefold().split()) if isinstance(value, str) else value


# -- merging the copies a store already holds (``reachy-memory dedupe``) -----------------------------


@dataclass(frozen=True)
class Merge:
    """One memory kept and the copies of it that go (each with the rule's reason)."""

    kept: Record
    copies: tuple[tuple[Record, str], ...]

    def to_dict(self) -> dict[str, Any]:
        """The report entry of this merge (texts cut at :data:`SHOWN_CHARS`, the first
        :data:`SHOWN_COPIES` copies listed, ``copies_count`` all of them)."""
        return {"kept": self.kept.id, "content": self.kept.content[:SHOWN_CHARS], "type": self.kept.type,
                "owner": self.kept.owner, "copies_count": len(self.copies),
                "copies": [{"id": rec.id, "content": rec.content[:SHOWN_CHARS], "reason": why}
                           for rec, why in self.copies[:SHOWN_COPIES]]}


def plan(records: Iterable[Record], vectors: VectorIndex, entity_keys: Sequence[str], now: float) -> list[Merge]:
    """The merges that leave one memory for each set of copies among ``records`` (live,
    mergeable ones; read under the store lock): the oldest of a set is kept, each later
    one is a copy when :func:`same` says so against a memory kept before it.  Only
    memories with the same content words are compared (a dict of them: linear in the
    records, but for sets of near-identical memories).  One pass (:func:`run` makes it
    in steps)."""
    live = _live(records, now)
    by_id = {rec.id: rec for rec in live}
    planner = _Planner(entity_keys)
    planner.feed(live, vectors, by_id.get)
    return planner.merges(0, len(planner.found), by_id.get)


def _live(records: Iterable[Record], now: float) -> list[Record]:
    """The memories :func:`plan` reads, oldest first."""
    return sorted((r for r in records if _plannable(r, now)), key=lambda r: (r.created, r.id))


def _plannable(rec: Record, now: float) -> bool:
    return mergeable(rec) and not rec.hidden and not rec.expired(now)


class _Planner:
    """:func:`plan`'s pass, fed the memories oldest first, in as many steps as wanted:
    each memory (as ``current`` returns it then, None when gone) compared with the ones
    kept before it with its content words."""

    def __init__(self, entity_keys: Sequence[str]) -> None:
        self._entity_keys = entity_keys
        self._kept_by: dict[tuple[Any, ...], list[str]] = {}  # content words -> ids kept, oldest first
        self._copies: dict[str, list[tuple[str, str]]] = {}  # kept id -> (copy id, reason)
        self.found: list[str] = []  # the kept ids with copies, in the order the first was found

    def feed(self, records: Sequence[Record], vectors: VectorIndex,
             current: Callable[[str], Record | None]) -> None:
        for rec in records:
            bucket = self._kept_by.setdefault(_words_key(rec), [])
            for kept_id in bucket:
                kept = current(kept_id)
                if kept is None:  # forgotten since it was kept (a step ago)
                    continue
                decision = same(kept, rec, _cosine(vectors, kept, rec), self._entity_keys)
                if decision.same:
                    if kept_id not in self._copies:
                        self.found.append(kept_id)
                    self._copies.setdefault(kept_id, []).append((rec.id, decision.reason))
                    break
            else:
                bucket.append(rec.id)

    def merges(self, start: int, stop: int, current: Callable[[str], Record | None]) -> list[Merge]:
        """The merges of ``found[start:stop]`` with their memories as ``current`` returns
        them (a memory gone since leaves its merge, or the copies, out)."""
        out = []
        for kept_id in self.found[start:stop]:
            kept = current(kept_id)
            copies = tuple((rec, why) for copy_id, why in self._copies[kept_id]
                           if (rec := current(copy_id)) is not None)
            if kept is not None and copies:
                out.append(Merge(kept, copies))
        return out


def merge_ops(merge: Merge, superseded_by: Mapping[str, list[Record]], *, max_bytes: int,
              max_keys: int) -> list[list[Any]]:
    """The journal ops of one :class:`Merge`: the kept memory refreshed as if each copy
    had been written after it (metadata merged oldest first, counts added, confirmed if
    any was), the copies deleted, and the memories a copy superseded pointed at the kept
    one (``superseded_by``: the records that name each id as their ``superseded_by``)."""
    kept, metadata = merge.kept, dict[str, Any]()
    for rec, _ in merge.copies:
        metadata |= {k: v for k, v in rec.metadata.items() if k not in (COUNT_KEY, TIME_KEY)}
    told = sum(1 + _count(rec) for rec, _ in merge.copies)
    at = max(last_told(rec) for rec, _ in merge.copies)
    fields = refreshed(kept, metadata, at, told=told, max_bytes=max_bytes, max_keys=max_keys)
    fields["last_access"] = max([fields["last_access"], *(r.last_access or r.created for r, _ in merge.copies)])
    if not kept.protected and any(rec.protected for rec, _ in merge.copies):
        fields["protected"] = True
    ops: list[list[Any]] = [["update", kept.id, fields]]
    for rec, _ in merge.copies:
        ops += [["update", old.id, {"superseded_by": kept.id}] for old in superseded_by.get(rec.id, ())]
        ops.append(["del", rec.id])
    return ops


MERGES_PER_FRAME = 256  # merges journaled together: an interrupted run keeps whole merges, a rerun does the rest
PLAN_STEP = 2000  # memories compared a step of a run (~0.1 s under the store lock); other requests go in between
# A pause between two steps: the store lock is not fair, and a thread waiting for it would
# not get it before this one takes it again (a search waited for the whole run).
STEP_PAUSE = 0.001
REPORTED = 200  # merges listed in a report (all are counted)
SHOWN_COPIES = 20  # copies listed for each (all are counted)
SHOWN_CHARS = 200  # of each text: a report stays small whatever the memories hold


def run(engine: Engine, *, dry_run: bool = False) -> dict[str, Any]:
    """Merge the copies among the stored fact and context memories (:func:`plan`), or with
    ``dry_run`` only say what would be merged.  Returns ``kept`` (memories that had
    copies), ``merged`` (copies deleted, or to be), ``dry_run`` and ``merges`` (the first
    :data:`REPORTED`: each kept memory with its copies and the rule's reason).  Every
    change goes through the journal, :data:`MERGES_PER_FRAME` merges a frame.  Holds the
    store lock a step at a time (:data:`PLAN_STEP` memories compared, ~50 us each, or a
    frame of merges), so a search or a write goes in between; on a store nothing else
    changes meanwhile the result is :func:`plan`'s.  A memory forgotten or no longer
    mergeable meanwhile is left out; one written meanwhile is not read (its write checked it)."""
    engine.require_open()
    limits = engine.dedupe_limits()
    now = time.time()
    with engine.lock:
        live = [rec.id for rec in _live(engine.state.records.values(), now)]
    planner = _Planner(limits.entity_keys)
    for start in range(0, len(live), PLAN_STEP):
        with engine.lock:
            state = engine.state
            step = [rec for memory_id in live[start : start + PLAN_STEP]
                    if (rec := state.records.get(memory_id)) is not None and _plannable(rec, now)]
            planner.feed(step, state.vectors, state.records.get)
        time.sleep(STEP_PAUSE)
    merges: list[Merge] = []
    for start in range(0, len(planner.found), MERGES_PER_FRAME):
        with engine.lock:
            records = engine.state.records
            frame = planner.merges(start, start + MERGES_PER_FRAME, records.get)
            merges += frame
            if frame and not dry_run:
                superseded_by: dict[str, list[Record]] = {}
                for rec in records.values():
                    if rec.superseded_by is not None:
                        superseded_by.setdefault(rec.superseded_by, []).append(rec)
                engine.commit([op for merge in frame
                               for op in merge_ops(merge, superseded_by, max_bytes=limits.max_bytes,
                                                   max_keys=limits.max_keys)])
        time.sleep(STEP_PAUSE)
    return {"dry_run": dry_run, "kept": len(merges), "merged": sum(len(m.copies) for m in merges),
            "merges": [m.to_dict() for m in merges[:REPORTED]]}


def _count(rec: Record) -> int:
    count = rec.metadata.get(COUNT_KEY)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def _cosine(vectors: VectorIndex, a: Record, b: Record) -> float | None:
    """The cosine of two stored memories' vectors (None when either has none)."""
    if a.vkey is None or b.vkey is None:
        return None
    rows = vectors.unit_rows(np.array([a.slot, b.slot], np.int64))
    if not rows[0].any() or not rows[1].any():
        return None
    return float(rows[0] @ rows[1])
