"""The restatement rule: does one text say what another says?

Pure functions over two texts and one cosine; :mod:`.dedupe` finds the candidates (a new
memory's nearest neighbours of the same type and owner), checks what text cannot say, and
merges.
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
   controlled by the plug" / "the plug controls the light", :func:`_active`).  Besides the
   words, their marks must match (:func:`_marked`): the "of", "for", "to" or "'s" before
   each, a past "-ed" ("lived" is not "lives") and, after "the", "a" or a possessive, a
   noun's plural or "-ing" ("Dad's papers" is not "Dad's paper").

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
is a password or a code, and "BLUE42SKY" is another one; a sentence giving a password,
a PIN, a code or a user name is compared as written (:func:`_verbatim`: "tiger!" is not
"tiger?", "blue-sky" not "bluesky").
A symbol is a word ("👍" is not "❤️"), and so are "-18", "1/2" and "1-2".

The store adds what text cannot say (:mod:`.dedupe`): the same owner, type, sharing and
subjects, and a fact dated relative to its telling ("today", "tomorrow", "last week") is
the same only when told again within the hour.

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
THRESHOLD = 0.88

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
_SYNONYMS = {"enjoy": "like", "fond": "like", "scare": "afraid", "frighten": "afraid",
             "talk": "speak", "normal": "usual"}
# Words no fact turns on: left out of the content words (rule 2 only; rule 1 keeps every word).
_LIGHT = frozenset("""
a an the is are am be being s of for to that this it do does
really usually normally generally typically actually just also still currently now nowadays kept
please definitely indeed basically
""".split())
# A password, PIN or code given with letters or symbols ("the wifi password is tiger!"): its value verbatim.
# A sentence that gives a password, a PIN, a code or a user name with letters or symbols in it ("the wifi
# password is tiger!", "the code to the gate is AB-CD"): compared as written (:func:`_verbatim`).
_SECRET = re.compile(r"(?i)\b(?:password|passcode|passphrase|username|user\s+name|login|pin|code|(?:wifi|wi-fi|network)"
                     r"\s+(?:key|name)|(?:wifi|wi-fi|network)\s+(?=is\s+(?:called|named)))\b.*?(?:\bis|\bwas|:)\s*"
                     r"(?:now\s+|still\s+|called\s+|named\s+)?(?!\d+[.,]?\s*$)\S+\s*$")
_NAME_IS = re.compile(r"\b(\w+)'s\s+name\s+is\s+")  # "the dog's name is Rex": "the dog is named Rex"
_CALLED = re.compile(r"\b(is|are|was|were)\s+(?:called|named)\b")  # named, not phoned: "is called Rex"
_USED_TO = re.compile(r"\b(?:is|are|am|was|were|be|been|being|get|gets|got|getting)\s+used\s+to\b")
_IS_A = re.compile(r"\b(\w+)'s\s+(?=(?:a|an|the)\s)")  # "Anna's a teacher": "Anna is a teacher"
_WORKS_AS = re.compile(r"\s+works?\s+as\s+")  # "Kate works as a teacher": "Kate is a teacher"
_ALLERGY = re.compile(r"\s+(?:has|have)\s+an?\s+(\w+)\s+allergy\b")  # "a nut allergy": "allergic to nut"
_MONTHS = "january|february|march|april|may|june|july|august|september|october|november|december"
_DAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_DAY_MONTH = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTHS})\b")  # "14 October": "October 14"
_MONTH_OR_DAY = re.compile(rf"\b(?:{_MONTHS}|{_DAYS})")
_ON_DATE = re.compile(rf"\bon\s+(?=(?:the\s+)?(?:\d{{1,2}}(?:st|nd|rd|th)?\b|(?:{_MONTHS}|{_DAYS})s?\b))")
# Two words of letters joined by a hyphen are one ("Wi-Fi", "tool-box"), but after a prefix that changes the
# word ("re-cover" is not "recover", "co-op" not "coop"); a secret's sentence is compared verbatim (_SECRET).
_HYPHEN = re.compile(r"(?<![\w\-@.])(?!(?:re|co|un|de|pre|non|multi|anti|pro)-)([^\W\d_]+)-([^\W\d_]+)"
                     r"(?![\w\-@]|\.\w)")  # not in an address ("anna-lee@gmail.com")
_AM_PM = re.compile(r"\b(\d{1,2}(?:[:.]\d\d)?)\s*([ap])\.?m\b\.?", re.IGNORECASE)  # "6 a.m.", "6 am": "6am"
_EVERY_ONE = {"day": "daily", "week": "weekly", "month": "monthly", "year": "yearly", "night": "nightly"}
_EVERY = re.compile(r"\b(?:every|each)\s+(day|week|month|year|night)\b")  # "every day": "daily"
_BE = frozenset({"is", "are", "am", "be", "being"})  # before a participle: the passive (:func:`_active`)
_PARTICLES = frozenset({"on", "off", "up", "down", "out", "in", "over", "away"})  # of a phrasal verb
# Content words (stemmed) that begin a phrase: where the agent of a passive ends ("by Dad | every month").
_PHRASE = frozenset(_STEM.stemWord(w) for w in """in on at after before during from with near under behind until
since around every each daily weekly monthly yearly nightly""".split())
_JOINS = frozenset({"for", "to"})  # what turns a compound around (:func:`_turned`)
# Verbs followed by "to" and a verb or by its -ing form alike (not "stop", "remember", "forget", "try").
_EITHER_FORM = frozenset(_STEM.stemWord(w) for w in "like love hate prefer start begin continue".split())
_OF = frozenset({"of"})
_MARKS = _JOINS | _OF | {"s", "ed", "pl", "ing"}  # light words (and inflections) kept as the next word's marks
_DETERMINERS = frozenset({"the", "a", "an", "s"})
_INFLECTIONS = frozenset({"ed", "pl", "ing"})  # marks of a word's own form, not words between
# A person's relations: "Lily's teacher" is "the teacher of Lily" (:func:`_turned`).
_RELATIONS = frozenset((_STEM.stemWord(w),) for w in """mother father mom dad parent sister brother son daughter
wife husband partner friend boss teacher doctor dentist nurse coach aunt uncle cousin niece nephew grandmother
grandfather grandma grandpa neighbor godmother godfather babysitter colleague""".split())
# Participles after which "by" says where, not who: "Tom is seated by Anna" (beside her).
_PLACED = frozenset(_STEM.stemWord(w) for w in """seated sat parked placed located kept left put hung hanging standing
stood situated lying sitting stored""".split())
_AGENT_GAP = frozenset({"the", "of", "s", "ed", "pl", "ing"})  # what a passive's agent may hold between its words
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
    if _SECRET.search(text) is not None:
        exact = _verbatim(text)
        return Text(exact, (exact,), False, ((),), ("",), False)
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
        if not gap and _infinitive_like(content, word):
            gap = ["to"]
        gap.extend(_inflection(word, stem, gap))
        gaps.append(tuple(gap))
        gap = []
    if "s" in gap:  # a possessive closing the sentence: "the kitten is Mia's" is not "... is Mia"
        content.append("'s")
        gaps.append(())
    return tuple(content), tuple(gaps)


def _inflection(word: str, stem: str, gap: list[str]) -> list[str]:
    """What the stem of ``word`` lost that a fact turns on, as marks: the past ("lived" is
    not "lives"; "is scared" is still "is afraid"), and after "the", "a" or a possessive,
    after "the", "a" or a possessive, a noun's number and its -ing ("Dad's papers" is not
    "Dad's paper", "Lucy's paintings" not "Lucy's paints")."""
    marks: list[str] = []
    if stem == word or len(word) < 4:
        return marks
    if word.endswith("ed") and not _BE.intersection(gap):
        marks.append("ed")
    if _DETERMINERS.intersection(gap):  # a noun: a verb's "-s" ("he lives") is no number
        if word.endswith("s") and not word.endswith(("ss", "us", "is")):
            marks.append("pl")
        if word.removesuffix("s").endswith("ing"):
            marks.append("ing")
    return marks


def _infinitive_like(content: list[str], word: str) -> bool:
    """Whether ``word``, the last of ``content``, is an -ing form that says what "to" and
    the verb would, right after a verb that means the same either way ("likes watching" is
    "likes to watch"; "stopped smoking" is not "stopped to smoke")."""
    return len(content) > 1 and content[-2] in _EITHER_FORM and len(word) > 5 and word.endswith("ing")


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
    return (content[by + 1:end] + content[verb:by] + content[:verb] + content[end:],
            gaps[by + 1:end] + ((),) * (by - verb) + gaps[:verb] + gaps[end:])


def _when(word: str) -> bool:
    """Whether ``word`` (a content word) is a date, a day, a time or a number."""
    return any(c.isdigit() for c in word) or word in _RELATIVE or _MONTH_OR_DAY.match(word) is not None


def normalized(text: str) -> str:
    """``text`` with case (but for codes), whitespace, punctuation, contractions, number
    words, spelling variants and a leading filler ("I know that") made uniform: two texts
    with equal ``normalized`` say the same thing in the same words.  (No stemming: what a
    search's collapse of copies reads, cheaper than :func:`read`.)"""
    return _normalized_cached(text) if len(text) <= CACHED_CHARS else _normalized_cached.__wrapped__(text)


@lru_cache(maxsize=2048)
def _normalized_cached(text: str) -> str:
    return _verbatim(text) if _SECRET.search(text) is not None else " ".join(_words(text))


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
    if "-" in text:
        text = _HYPHEN.sub(r"\1\2", text)
    if "m" in text or "M" in text:
        text = _AM_PM.sub(lambda m: f"{m.group(1)}{m.group(2).lower()}m", text)
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
        folded = _NAME_IS.sub(r"\1 is named ", folded)
    if " called" in folded or " named" in folded:
        folded = _CALLED.sub(r"\1 named", folded)
    if " used to" in folded:
        folded = _USED_TO.sub("is accustomed to", folded)
    if "'s a" in folded or "'s the" in folded:
        folded = _IS_A.sub(r"\1 is ", folded)
    if "allergy" in folded:
        folded = _ALLERGY.sub(r" is allergic to \1", folded)
    if "every " in folded or "each " in folded:
        folded = _EVERY.sub(lambda m: _EVERY_ONE[m.group(1)], folded)
    if _MONTH_OR_DAY.search(folded):
        folded = _DAY_MONTH.sub(r"\2 \1", _ON_DATE.sub("", folded))
    return [_NUMBERS.get(w) or _SPELLING.get(w) or w for w in _WORD.findall(folded)]


def _verbatim(text: str) -> str:
    """A secret's sentence as written: whitespace collapsed, its first letter and a last
    full stop aside ("The wifi password is Blue42Sky." is "the wifi password is Blue42Sky";
    "tiger!" is not "tiger?", "blue-sky" not "bluesky", "Tiger" not "tiger")."""
    text = " ".join(unicodedata.normalize("NFKC", text).split()).removesuffix(".")
    return text[:1].casefold() + text[1:]


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
    visit"), parts right after another word, as a verb's objects are ("pays Anna rent" /
    "pays rent for Anna"), a possessive just after them (a chain), and texts of more than
    :data:`MOVES_WORDS` content words (the check is quadratic)."""
    x, y = a.content, b.content
    if len(x) != len(y) or x == y or len(x) > MOVES_WORDS or not (a.turnable and b.turnable):
        return False
    start = next(i for i in range(len(x)) if x[i] != y[i])
    end = len(x) - next(i for i in range(len(x)) if x[-1 - i] != y[-1 - i])
    if a.marks[:start] != b.marks[:start] or a.marks[end:] != b.marks[end:] or "to" in a.marks[start] \
            or "to" in b.marks[start] or (end < len(x) and "s" in a.marks[end] + b.marks[end]) \
            or any(_when(word) for word in x[start:end]) \
            or (start > 0 and not (set(a.gaps[start]) - _INFLECTIONS and set(b.gaps[start]) - _INFLECTIONS)):
        return False
    for cut in range(start + 1, end):
        moved = start + end - cut  # where ``a``'s first part begins in ``b``
        between = set(a.gaps[cut]) - _INFLECTIONS
        joins = _JOINS if not between else _OF if between == {"s"} and x[cut:end] in _RELATIONS else None
        if joins and y[start:end] == x[cut:end] + x[start:cut] and joins.intersection(b.gaps[moved]) \
                and _compounds(a, start, cut, end) and _compounds(b, start, moved, end):
            return True
    return False


def _compounds(text: Text, start: int, cut: int, end: int) -> bool:
    """Whether the words ``[start:cut]`` and ``[cut:end]`` of ``text`` are each one phrase:
    nothing but a possessive between their words ("Grandma's hearing aid")."""
    return all(set(text.gaps[i]) <= _INFLECTIONS | {"s"} for i in range(start + 1, end) if i != cut)


def relative(text: str) -> bool:
    """Whether ``text`` is dated relative to its telling ("tomorrow", "last week")."""
    return read(text).relative
