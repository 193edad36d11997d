"""Rule-based reading of person references and of the persons a sentence mentions.

Two entry points, both pure:

* :func:`parse_reference` reads one reference as a caller passes it
  (``subjects=["my wife"]``, ``about="Sarah"``): "my wife", "wife", "my wife's",
  "Sarah", "sarah", "my wife Sarah", "Sarah, my wife", "mom" -> a
  :class:`Reference` (name, relation, pronoun);
* :func:`extract_mentions` finds the references inside a sentence:
  "remember my wife's name is Sarah" -> [wife named Sarah];
  "Sarah and John are getting married" -> [Sarah, John];
  "she likes Italian food" -> [pronoun "she"] (the registry resolves it to
  the most recent person in context).

Rules, in order: (1) a relation word after "my"/"our"/"the user's", with a
name taken from "...'s name is X", "... is called X", "my wife X",
"X is my wife", "X, my wife"; (2) runs of capitalised words, minus a stop list
(sentence starters, days, months, nationalities, "User", the robot's name),
minus words with a digit and acronyms ("Banana42", "TV"; initials beside a relation,
"my son AJ", are a name), and minus words right after
"in/at/from/to/near" (places, employers) or after "dog named"/"cat called"
(pets); (3) names and aliases of people already known, in any case;
(4) singular pronouns she/her/he/him/his, kept only when nothing else names a
person.

Limits (stated, not hidden): English only; a lowercase unknown name
("sarah likes tea" before Sarah is known) is not found; brands or places
outside the preposition rule ("Sarah loves Netflix") read as names; "they"
is never resolved (singular or plural is undecidable by rule); gender comes
only from the relation (wife -> she), names carry none.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

MAX_NAME_WORDS = 5  # "Mary Ann de la Cruz"; longer capitalised runs are titles or shouting

# Canonical relation for each accepted spelling.
_RELATION_SYNONYMS = {
    "mom": "mother", "mum": "mother", "mommy": "mother", "mummy": "mother", "mama": "mother", "ma": "mother",
    "dad": "father", "daddy": "father", "papa": "father", "pa": "father",
    "grandma": "grandmother", "granny": "grandmother", "nana": "grandmother", "gran": "grandmother",
    "grandpa": "grandfather", "granddad": "grandfather", "grandad": "grandfather",
    "hubby": "husband", "bf": "boyfriend", "gf": "girlfriend", "neighbor": "neighbour", "co-worker": "coworker",
    "fiance": "fiancé", "fiancee": "fiancée", "kid": "child", "bestie": "best friend",
}
_RELATIONS = frozenset({
    "wife", "husband", "partner", "spouse", "fiancé", "fiancée", "girlfriend", "boyfriend", "son", "daughter",
    "child", "baby", "mother", "father", "parent", "brother", "sister", "sibling", "grandmother", "grandfather",
    "grandson", "granddaughter", "aunt", "uncle", "cousin", "niece", "nephew", "friend", "best friend", "boss",
    "manager", "colleague", "coworker", "neighbour", "roommate", "flatmate", "landlord", "landlady", "teacher",
    "doctor", "dentist", "nurse", "therapist", "nanny", "babysitter", "cleaner", "coach", "tutor", "stepmother",
    "stepfather", "stepson", "stepdaughter", "mother-in-law", "father-in-law", "sister-in-law", "brother-in-law",
    "son-in-law", "daughter-in-law", "godmother", "godfather", "carer", "caregiver",
}) | frozenset(_RELATION_SYNONYMS)
_FEMALE = frozenset({
    "wife", "fiancée", "girlfriend", "daughter", "mother", "sister", "grandmother", "granddaughter", "aunt", "niece",
    "landlady", "stepmother", "stepdaughter", "mother-in-law", "sister-in-law", "daughter-in-law", "godmother",
})
_MALE = frozenset({
    "husband", "fiancé", "boyfriend", "son", "father", "brother", "grandfather", "grandson", "uncle", "nephew",
    "landlord", "stepfather", "stepson", "father-in-law", "brother-in-law", "son-in-law", "godfather",
})
_PRONOUNS = {"she": "she", "her": "she", "hers": "she", "herself": "she",
             "he": "he", "him": "he", "his": "he", "himself": "he"}
_STOP = frozenset("""
i i'm i've i'd i'll me myself the a an this that these those my our your his her their its we you he she they it
remember note please tell ask remind don't do does did can could would should will is are was were have has had
what when where who why how which yes no ok okay hi hello hey thanks thank also and but or so then if because
today tomorrow yesterday tonight now later soon every each all some maybe sure well oh just perhaps
on in at for with after before during since until about from to by of into there here let let's last next
monday tuesday wednesday thursday friday saturday sunday january february march april may june july august
september october november december christmas easter
english french italian spanish german chinese japanese korean thai indian mexican greek turkish american british
irish scottish canadian australian russian portuguese dutch swedish vietnamese lebanese moroccan brazilian arabic
hindi european asian african
user users user's reachy robot assistant wi-fi wifi bluetooth internet email e-mail password pin tv
""".split())  # the last line: who the robot talks to, the robot itself, and household words of a sentence's start
# Words that start the subject-less facts an LLM writes all the time ("Likes green tea", "Trash
# day is Monday"): not names at the start of a sentence; elsewhere they may be ("Courtney Love").
_STARTERS = frozenset("""
likes like loves love prefers prefer hates hate enjoys enjoy dislikes dislike wants want needs need usually often
always never sometimes allergic favorite favourite works lives plays drinks eats takes goes speaks studies owns
gets uses watches reads listens drives walks visits calls feels thinks knows believes wakes sleeps keeps
trash garbage rubbish recycling bins dinner lunch breakfast meeting appointment medication medicine pills keys
car rent coffee tea laundry groceries shopping homework school office gym practice birthday anniversary
""".split())
_PLACE_PREPOSITIONS = frozenset({"in", "at", "from", "to", "near", "into", "visiting", "for"})
_OWNER_WORDS = r"(?:my|our|the\s+user's|user's|the\s+user’s)"
_REL_ALT = "|".join(sorted((re.escape(r) for r in _RELATIONS), key=len, reverse=True))
_HONORIFIC = r"(?:(?:Mr|Mrs|Ms|Miss|Dr|Prof)\.?\s+)"
_NAME = rf"{_HONORIFIC}?[A-Z][\w'’-]*(?:\s+[A-Z][\w'’-]*)*"
_REL_PHRASE = re.compile(rf"\b{_OWNER_WORDS}\s+({_REL_ALT})\b(?:'s|’s)?", re.IGNORECASE)
_NAME_AFTER = re.compile(rf"^(?:'s|’s)?\s*(?:name\s+is|is\s+called|is\s+named|called|named|,)?\s*({_NAME})")
_NAME_BEFORE = re.compile(rf"({_NAME})\s*(?:,|\bis)\s*$")
_CAPITALISED = re.compile(_NAME)
_PETS = r"(?:dog|cat|pet|puppy|kitten|parrot|fish|hamster|rabbit|horse|bird)"
_PET_BEFORE = re.compile(rf"\b{_PETS}\s+(?:named|called)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Reference:
    """One reference to a person: a name, a relation, both, or a pronoun."""

    name: str | None = None  # as written, with the caller's capitalisation
    relation: str | None = None  # canonical ("mom" -> "mother")
    pronoun: str | None = None  # "she" or "he"

    @property
    def empty(self) -> bool:
        return not (self.name or self.relation or self.pronoun)


@dataclass(frozen=True, slots=True)
class Mention:
    """A reference found in a sentence, with its character offset."""

    reference: Reference
    start: int


def norm(text: str) -> str:
    """Case- and width-insensitive key: NFKC, casefold, straight quotes, single spaces."""
    text = unicodedata.normalize("NFKC", text).replace("’", "'").casefold()
    return " ".join(text.split()).strip(" .,!?;:\"()[]")


def canonical_relation(word: str) -> str | None:
    """The canonical relation for ``word`` ("Mom" -> "mother"), or None if not a known relation."""
    key = norm(word)
    key = _RELATION_SYNONYMS.get(key, key)
    return key if key in _RELATIONS else None


def pronoun_gender(relation: str | None) -> str | None:
    """"she", "he" or None (unknown) for a canonical relation."""
    if relation in _FEMALE:
        return "she"
    return "he" if relation in _MALE else None


def parse_reference(text: str) -> Reference:
    """Read one reference ("my wife", "wife", "Sarah", "my wife Sarah", "Sarah, my wife", "she")."""
    key = norm(text)
    if key in _PRONOUNS:
        return Reference(pronoun=_PRONOUNS[key])
    mentions = extract_mentions(text)
    named = [m.reference for m in mentions if m.reference.pronoun is None]
    if len(named) == 1:
        return named[0]
    return _fallback_reference(text)


def _fallback_reference(text: str) -> Reference:
    """A reference the sentence rules did not read: "my physio", "sarah", "the O'Neils"."""
    cleaned = " ".join(unicodedata.normalize("NFKC", text).replace("’", "'").split()).strip(" .,!?;:\"()[]")
    cleaned = re.sub(r"'s?$", "", cleaned)
    owned = re.match(rf"^{_OWNER_WORDS}\s+(.+)$", cleaned, re.IGNORECASE)
    if owned:
        word = owned.group(1)
        return Reference(relation=canonical_relation(word) or norm(word))
    relation = canonical_relation(cleaned)
    if relation:
        return Reference(relation=relation)
    return Reference(name=cleaned) if cleaned else Reference()


def extract_mentions(sentence: str, known: Iterable[str] = ()) -> list[Mention]:
    """The person references in ``sentence``, in order (see the module doc for rules and limits).

    ``known`` are names and aliases of people already known; they are found in
    any case.  Pronoun mentions are returned only when nothing else is.
    """
    text = unicodedata.normalize("NFKC", sentence)
    taken: list[tuple[int, int]] = []
    found = _relation_mentions(text, taken)
    found += _name_mentions(text, taken)
    found += _known_mentions(text, known, taken)
    if not found:
        found = _pronoun_mentions(text)
    return _dedupe(sorted(found, key=lambda m: m.start))


def _relation_mentions(text: str, taken: list[tuple[int, int]]) -> list[Mention]:
    out = []
    for match in _REL_PHRASE.finditer(text):
        relation = canonical_relation(match.group(1))
        name, span = _name_near(text, match.start(), match.end())
        taken.append((match.start(), match.end()))
        if span:
            taken.append(span)
        out.append(Mention(Reference(name=name, relation=relation), match.start()))
    return out


def _name_near(text: str, start: int, end: int) -> tuple[str | None, tuple[int, int] | None]:
    """A name right after ("my wife Sarah", "my wife's name is Sarah") or before ("Sarah, my wife")."""
    after = _NAME_AFTER.match(text[end:])
    if after:
        runs = _name_runs(text, end + after.start(1), end + after.end(1), initials=True)
        if runs and runs[0][0] == end + after.start(1) and _is_name(text[slice(*runs[0])]):
            return _clean_name(text[slice(*runs[0])]), runs[0]
    before = _NAME_BEFORE.search(text[:start])
    if before:
        runs = _name_runs(text, before.start(1), before.end(1), initials=True)
        if runs and runs[-1][1] == before.end(1) and _is_name(text[slice(*runs[-1])]):
            return _clean_name(text[slice(*runs[-1])]), runs[-1]
    return None, None


def _name_mentions(text: str, taken: list[tuple[int, int]]) -> list[Mention]:
    out = []
    for match in _CAPITALISED.finditer(text):
        for start, end in _name_runs(text, match.start(), match.end()):
            if _overlaps(start, end, taken) or _is_place_or_pet(text, start):
                continue
            word = text[start:end]
            relation = canonical_relation(word)  # "Mom said..." names the mother
            ref = Reference(relation=relation) if relation else Reference(name=_clean_name(word))
            taken.append((start, end))
            out.append(Mention(ref, start))
    return out


def _name_runs(text: str, start: int, end: int, initials: bool = False) -> list[tuple[int, int]]:
    """Split a capitalised run at stop words: "Remember Sarah" -> "Sarah"; runs of more
    than MAX_NAME_WORDS words (titles, shouting) are not names.  ``initials``: beside a
    relation ("my son AJ", "KC is my wife") two or three capitals are a name."""
    runs: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for token in re.finditer(r"\S+", text[start:end]):
        t_start, t_end = start + token.start(), start + token.end()
        if not _name_word(token.group(), initials) or (norm(token.group().strip(" ,.;:!?")) in _STARTERS
                                                       and _opens_sentence(text, t_start)):  # cheap test first
            current = None
            continue
        current = (current[0], t_end) if current else (t_start, t_end)
        if runs and runs[-1][0] == current[0]:
            runs[-1] = current
        else:
            runs.append(current)
    return [r for r in runs if len(text[r[0]:r[1]].split()) <= MAX_NAME_WORDS]


def _known_mentions(text: str, known: Iterable[str], taken: list[tuple[int, int]]) -> list[Mention]:
    out = []
    for name in sorted({k for k in known if len(norm(k)) >= 2}, key=len, reverse=True):
        for match in re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE):
            if not _overlaps(match.start(), match.end(), taken):
                taken.append((match.start(), match.end()))
                out.append(Mention(Reference(name=name), match.start()))
    return out


def _pronoun_mentions(text: str) -> list[Mention]:
    out = []
    for match in re.finditer(r"\b(she|her|hers|herself|he|him|his|himself)\b", text, re.IGNORECASE):
        out.append(Mention(Reference(pronoun=_PRONOUNS[match.group(1).lower()]), match.start()))
    return out


def _dedupe(mentions: list[Mention]) -> list[Mention]:
    seen: set[tuple[str | None, str | None, str | None]] = set()
    out = []
    for mention in mentions:
        ref = mention.reference
        key = (norm(ref.name) if ref.name else None, ref.relation, ref.pronoun)
        if key not in seen:
            seen.add(key)
            out.append(mention)
    return out


_OTHERS_RELATION = re.compile(rf"(?:\b(?:his|her|their|your|its)\s+|['’]s\s+)(?:{_REL_ALT})\b", re.IGNORECASE)
_SEVERAL = re.compile(r"\s(?:and|&)\s|[,;/]", re.IGNORECASE)


_AND = re.compile(r"\s(?:and|&)\s", re.IGNORECASE)
# What a caller says for the user or the robot (or everyone at home) where a person is
# expected: a fact about them is about nobody in particular.
_SELF = frozenset("""
i me myself you yourself user users user's reachy robot assistant we us ourselves everyone everybody
""".split()) | {"reachy mini", "the user", "the users", "the user's", "the robot", "the assistant", "me and you"}


def means_user_or_robot(text: str) -> bool:
    """Whether ``text`` is one of the words for the user, the robot or everyone ("me",
    "the user", "Reachy Mini", "us"), not a person's name ("Will", "June" are names)."""
    return norm(text.strip(" .,!?;:\"'()[]")) in _SELF


def reference_problem(text: str, ref: Reference) -> str | None:
    """Why ``text`` (read as ``ref``) cannot stand for one person the user knows, as
    the end of a sentence telling a caller what to send instead; None if it can."""
    if not any(ch.isalpha() for ch in text):
        return "does not name a person: give a name or a relation ('Sarah', 'my wife')"
    if _OTHERS_RELATION.search(text):  # "her brother", "Sarah's brother", "my wife's brother"
        return ("is a relation of someone other than the user: give that person's own name ('Tom'), "
                "or what they are to the user ('my brother-in-law')")
    several = _AND if ref.relation is not None else _SEVERAL  # "Sarah, my wife" is one person
    if several.search(text):
        parts = [part.strip() for part in several.split(text) if part.strip()]
        return f"names several persons: give one per subject ({parts!r})"
    return None


def _name_word(token: str, initials: bool = False) -> bool:
    """Whether a capitalised token can be part of a name: not a stop word, no digit
    ("Banana42", "R2"), not an acronym of two or more capitals ("TV", "NASA"), except
    initials of two or three capitals where ``initials`` ("AJ" beside "my son")."""
    word = re.sub(r"['’]s$", "", token).strip(" ,.;:!?\"()[]")
    if norm(word) in _STOP or any(ch.isdigit() for ch in word):
        return False
    letters = [ch for ch in word if ch.isalpha()]
    acronym = len(letters) >= 2 and all(ch.isupper() for ch in letters)
    return not acronym or (initials and len(letters) <= 3)


def _opens_sentence(text: str, at: int) -> bool:
    """Whether the word at ``at`` is the first of a sentence."""
    return not text[:at].strip() or bool(re.search(r"[.!?:;]\s*$", text[:at]))


def _is_name(candidate: str) -> bool:
    return canonical_relation(candidate) is None


def _clean_name(name: str) -> str:
    return re.sub(r"['’]s?$", "", name.strip(" ,.;:!?"))


def _is_place_or_pet(text: str, start: int) -> bool:
    before = text[:start].rstrip()
    last = before.rsplit(None, 1)[-1].lower() if before else ""
    return last in _PLACE_PREPOSITIONS or bool(_PET_BEFORE.search(text[:start]))


def _overlaps(start: int, end: int, taken: list[tuple[int, int]]) -> bool:
    return any(start < t_end and t_start < end for t_start, t_end in taken)
