"""The restatement rule: is a new fact the same as one already kept?

Pure functions over texts and one cosine; the store finds the candidates (the new
memory's nearest neighbours of the same type and owner) and decides nothing else.
Two memories are the same when:

1. **their normalized texts are equal** (:func:`normalized`): case (but for codes),
   whitespace and punctuation aside, contractions expanded ("doesn't" / "does not"),
   numbers in words or digits ("two" / "2"), dates either way round ("on 14 October" /
   "October 14"), British or American spelling, "works as a" / "is a", "has a nut
   allergy" / "is allergic to nut", and a leading filler dropped ("I know that ...",
   "Remember that ...", "FYI: ...");
2. or **they say it with the same content words in the same order** (up to a phrase
   moved from one end to the other: "Every evening Mia walks the dog") and words that
   carry no fact ("really", "usually", "kept", "the", "is") added or dropped, and the
   cosine of their embeddings is at least :data:`THRESHOLD`.

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

Codes keep their case: a word mixing letters and digits or with a capital inside
("Blue42Sky", "sunFlower7") is a password or a code, and "BLUE42SKY" is another one.

The store adds what text cannot say: the same owner, type, sharing and subjects,
and a fact dated relative to its telling ("today", "tomorrow", "last week") is the
same only when told again within :data:`RELATIVE_SECONDS`.

The threshold was chosen with ``tools/eval_dedupe.py`` (chosen on one half of the
labelled pairs, reported on the other, both ways; precision first).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

import snowballstemmer

#: Rule 2's cosine floor (fp32 or int8 vectors of the configured model); see the module doc.
THRESHOLD = 0.92
#: A fact dated relative to its telling is only restated within this many seconds.
RELATIVE_SECONDS = 3600.0

_STEM = snowballstemmer.stemmer("english")
_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})
_WORD = re.compile(r"[^\W_]+(?:[.:,][0-9]+)*")  # "8:15", "3.5" and "1,000" stay one word
_IRREGULAR = ((r"\bcan't\b", "can not"), (r"\bcannot\b", "can not"), (r"\bwon't\b", "will not"),
              (r"\bshan't\b", "shall not"), (r"\bain't\b", "is not"))
_CONTRACTIONS = ((r"n't\b", " not"), (r"'re\b", " are"), (r"'m\b", " am"), (r"'ve\b", " have"),
                 (r"'ll\b", " will"))
# Leading words that say "this is a fact" and add none: dropped, repeatedly.
_FILLER = re.compile(
    r"^\s*(?:(?:i\s+know|i\s+remember|remember|please\s+remember|note|please\s+note|do\s+not\s+forget|"
    r"keep\s+in\s+mind|bear\s+in\s+mind|i\s+want\s+you\s+to\s+know|i\s+told\s+you|you\s+should\s+know)"
    r"\s+that\b|just\s+so\s+you\s+know\b|fyi\b|for\s+your\s+information\b|by\s+the\s+way\b|btw\b|"
    r"for\s+the\s+record\b|as\s+you\s+know\b|remember\s*:|note\s*:|reminder\s*:)[\s,:;.!-]*")
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
_WORKS_AS = re.compile(r"\s+works?\s+as\s+")  # "Kate works as a teacher": "Kate is a teacher"
_ALLERGY = re.compile(r"\s+(?:has|have)\s+an?\s+(\w+)\s+allergy\b")  # "a nut allergy": "allergic to nut"
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_DAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_DAY_MONTH = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTHS})\b")  # "14 October": "October 14"
_ON_DATE = re.compile(rf"\bon\s+(?=(?:the\s+)?(?:\d{{1,2}}(?:st|nd|rd|th)?\b|(?:{_MONTHS}|{_DAYS})s?\b))")
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
    content = tuple(_SYNONYMS.get(stem, stem) for stem in (_stem(w) for w in words if w not in _LIGHT))
    relative = any(w in _RELATIVE for w in words) or _RELATIVE_PHRASE.search(norm) is not None
    return Text(norm, content, relative)


def normalized(text: str) -> str:
    """``text`` with case (but for codes), whitespace, punctuation, contractions, number
    words, spelling variants and a leading filler ("I know that") made uniform: two texts
    with equal ``normalized`` say the same thing in the same words."""
    return read(text).normalized


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
    if not _rotation(new.content, old.content):
        return Decision(False, "word order differs")
    if similarity is None:
        return Decision(False, "no embedding to compare")
    if similarity < threshold:
        return Decision(False, f"cosine {similarity:.3f} below {threshold:.2f}")
    return Decision(True, f"the same words, cosine {similarity:.3f}")


def _words(text: str) -> list[str]:
    """The words of ``text``: NFKC, case folded but for codes, contractions expanded,
    a leading filler dropped, number words as digits, one spelling."""
    text = unicodedata.normalize("NFKC", text).translate(_QUOTES)
    folded = " ".join(w if _is_code(w) else w.casefold() for w in text.split())
    for pattern, full in (*_IRREGULAR, *_CONTRACTIONS):
        folded = re.sub(pattern, full, folded)
    while (filler := _FILLER.match(folded)) is not None and filler.end() > 0:
        folded = folded[filler.end():]
    folded = _ALLERGY.sub(r" is allergic to \1", _WORKS_AS.sub(" is ", folded))
    folded = _DAY_MONTH.sub(r"\2 \1", _ON_DATE.sub("", folded))
    words = _WORD.findall(folded)
    return [_NUMBERS.get(w) or _SPELLING.get(w) or w for w in words]


def _is_code(word: str) -> bool:
    """A password or code: letters and digits mixed, or a capital after a small letter."""
    letters = any(c.isalpha() for c in word)
    return (letters and any(c.isdigit() for c in word)) or re.search(r"[a-z][A-Z]", word) is not None


@lru_cache(maxsize=8192)
def _stem(word: str) -> str:
    return word if word[0].isdigit() or not word.islower() else _STEM.stemWord(word)


def _negated(content: tuple[str, ...]) -> bool:
    return sum(w in _NEGATION for w in content) % 2 == 1


def _numbers(content: tuple[str, ...]) -> list[str]:
    return sorted(w for w in content if any(c.isdigit() for c in w))


def _rotation(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """``a`` is ``b`` with a run of words moved from its end to its front (or ``b`` itself);
    two words swapped are another statement ("the car is Tom's" / "Tom is the car's")."""
    if len(a) != len(b):
        return False
    if len(b) < 3:
        return a == b
    return any(a == b[i:] + b[:i] for i in range(len(b)))


def relative(text: str) -> bool:
    """Whether ``text`` is dated relative to its telling ("tomorrow", "last week")."""
    return read(text).relative
