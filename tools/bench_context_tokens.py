"""What the conversation app pastes at the start of a conversation, in tokens: its own memory
(every fact of memory.v1.json, up to 60, under its header) against reachy-memory's
``memory_context`` block (the people the robot knows and the facts that matter, within a token
budget) over the same facts.

Sixty facts as the app stores them (short third-person sentences, some about people the user
knows) are remembered in a store in this process (the real model); both texts are counted
with the embedder's tokenizer (the one ``context_for`` budgets with; a realtime model's own
tokenizer counts English within a few percent of it). Prints the token counts, how many of the
60 facts each text holds, and whether the facts a first sentence asks about are in the block.

    python -m tools.bench_context_tokens [--budget 600]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PEOPLE = ["Sarah", "Tom", "Mia", "Grandpa Joe", "Lena"]
THINGS = ["likes Italian food", "is allergic to peanuts", "plays chess on Sundays", "has a birthday in May",
          "is learning the piano", "works as a nurse", "prefers tea to coffee", "is afraid of spiders",
          "supports the local football team", "is training for a half marathon", "collects stamps",
          "visits every second weekend"]
USER = ["Has a dog named Mochi", "Prefers replies in French when tired", "Works from home on Mondays and Fridays",
        "Is vegetarian since 2019", "Plays the cello in a community orchestra", "Wakes up at 6:30 on weekdays",
        "Is planning a trip to Japan next spring", "Dislikes loud music in the evening",
        "Keeps the spare key under the blue flower pot", "Waters the tomatoes every evening"]
HEADER = ("Things you remember about the user (use this context naturally,\n"
          "do not recite the list verbatim):")  # the app's own header (memory.py)
FIRST_WORDS = "Sarah is coming over for dinner tonight, what should I cook?"


def facts() -> list[tuple[str, list[str]]]:
    """Sixty facts and who each is about: 10 about the user, 50 about five people they know."""
    about_people = [(f"{person} {thing}", [person]) for thing in THINGS for person in PEOPLE][:50]
    return [(text, []) for text in USER] + about_people


def _padded(text: str, chars: int = 280) -> str:
    """``text`` told at length, to the app's cap on a fact (what a chatty model saves)."""
    filler = " as they said while talking about their week, their plans and the people around them"
    return (text + filler * 4)[:chars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=600, help="memory_context's max_tokens")
    args = parser.parse_args()
    from reachy_memory import MemoryStore
    from reachy_memory.config import load_config
    from reachy_memory.engine.context_text import token_counter, tokenizer_path
    from reachy_memory.integrations.tools import CONTEXT_MEMORIES, DEFAULT_CONTEXT_MESSAGE

    config = load_config(ROOT / "config" / "default.yaml")
    count = token_counter(tokenizer_path(config))
    all_facts = facts()
    app_paste = "\n".join([HEADER, *(f"- {text}" for text, _ in reversed(all_facts))])
    with tempfile.TemporaryDirectory() as tmp, MemoryStore(Path(tmp), config=config) as store:
        for text, subjects in all_facts:
            store.remember(text, subjects=subjects)
        rows = [("the app's paste (every fact)", app_paste),
                ("the app's paste, facts at its 280-char cap", "\n".join([HEADER, *(f"- {_padded(text)}"
                                                                            for text, _ in all_facts)]))]
        for label, message in (("memory_context, no first words", DEFAULT_CONTEXT_MESSAGE),
                               ("memory_context, first words", FIRST_WORDS)):
            block = store.context_for(message, max_tokens=args.budget, max_memories=CONTEXT_MEMORIES).text
            rows.append((f"{label} (budget {args.budget})", block))
    print(f"{'text':48} {'tokens':>7} {'facts':>6}")
    for label, text in rows:
        held = sum(1 for fact, _ in all_facts if fact in text)
        print(f"{label:48} {count(text):7d} {held:6d}")
    block = rows[-1][1]
    about_sarah = [fact for fact, who in all_facts if who == ["Sarah"]]
    print(f"first words {FIRST_WORDS!r}: {sum(f in block for f in about_sarah)} of the {len(about_sarah)} "
          f"facts about Sarah in the block")


if __name__ == "__main__":
    main()
