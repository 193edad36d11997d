"""Markdown export and import (``_markdown``, spec 003): exact round trips, hand-written
files, hostile input, safe folders."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory import ValidationError
from reachy_memory._markdown import parse, read_dir, render, write_dir

TIMES = st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)).map(
    lambda d: d.replace(microsecond=0).isoformat())
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40).filter(str.strip)


@st.composite
def stores(draw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n_people = draw(st.integers(0, 3))
    people = [{"id": f"p{i:031d}", "name": draw(st.sampled_from(["Sarah", "sarah", "John", "", "Zoë"])),
               "relation": draw(st.sampled_from([None, "wife", "son"])),
               "aliases": draw(st.lists(st.sampled_from(["Sassy", "J"]), max_size=2, unique=True)),
               "owner": draw(st.sampled_from([None, "alex"])), "external_id": None, "metadata": {},
               "created_at": draw(TIMES), "updated_at": draw(TIMES)} for i in range(n_people)]
    for p in people:
        if not p["name"] and not p["relation"]:
            p["relation"] = "friend"
    memories = []
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["fact", "fact", "conversation", "context"]))
        subjects = draw(st.lists(st.sampled_from([p["id"] for p in people]), max_size=2, unique=True)) if people else []
        memory = {"id": f"m{i:031d}", "content": draw(st.one_of(TEXT, st.just("two\nlines"), st.just("~~x~~"))),
                  "type": kind, "created_at": draw(TIMES), "expires_at": None,
                  "metadata": draw(st.sampled_from([{}, {"role": "user"}, {"n": 1, "tags": ["a", "b"]}])),
                  "subjects": subjects, "owner": draw(st.sampled_from([None, "alex"])),
                  "shared": draw(st.booleans()), "name": None, "aliases": [], "superseded_at": None,
                  "superseded_by": None, "protected": draw(st.booleans()), "covers_until": None}
        if kind == "fact" and draw(st.booleans()) and i == 0:
            memory |= {"name": draw(st.sampled_from(["plant care", "wifi"])), "aliases": ["ferns"]}
        if i > 0 and draw(st.booleans()):
            memory |= {"superseded_by": memories[-1]["id"], "superseded_at": draw(TIMES)}
        memories.append(memory)
    return memories, people


def _clean(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records compared field by field, defaults dropped (they are left out of the files)."""
    return sorted(({k: v for k, v in d.items() if v not in (None, [], {}, False)} for d in items),
                  key=lambda d: d["id"])


@settings(max_examples=80, deadline=None)
@given(stores())
def test_render_then_parse_gives_back_every_memory_and_person(data: tuple[list[dict[str, Any]], ...]) -> None:
    memories, people = data
    got_memories, got_people = parse(render(memories, people), new_id=lambda: "NEW")
    assert _clean(got_people) == _clean(people)
    assert _clean(got_memories) == _clean(memories)


def test_hand_written_files_become_sensible_records() -> None:
    ids = (f"id{n}" for n in itertools.count())
    files = {
        "people/sarah.md": "---\nname: Sarah\nrelation: wife\naliases: [Sassy]\n---\n- likes Italian food\n"
                           "- plays the cello\nnot a list line\n",
        "world.md": "# World\n\n- The wifi password is on the fridge\n",
        "daily/2026-11-02.md": "- 14:05 user: shall we go to the park?\n- 14:06 assistant: yes!\n- no time\n",
        "notes/plants.md": "---\nname: plant care\naliases: [ferns]\n---\nWater the ferns on Sundays.\n",
    }
    memories, people = parse(files, new_id=lambda: next(ids), now="2026-11-22T10:00:00+00:00")
    assert [(p["name"], p["relation"], p["aliases"]) for p in people] == [("Sarah", "wife", ["Sassy"])]
    sarah = people[0]["id"]
    by_content = {m["content"]: m for m in memories}
    food = by_content["likes Italian food"]
    assert food["subjects"] == [sarah] and food["type"] == "fact"
    assert by_content["The wifi password is on the fridge"]["subjects"] == []
    turn = by_content["shall we go to the park?"]
    assert turn["type"] == "conversation" and turn["created_at"] == "2026-11-02T14:05:00+00:00"
    assert turn["metadata"] == {"role": "user"} and "no time" in by_content
    note = by_content["Water the ferns on Sundays."]
    assert note["name"] == "plant care" and note["aliases"] == ["ferns"]


@pytest.mark.parametrize(("files", "message"), [
    ({"people/x.md": "no front matter\n- fact\n"}, "front matter"),  # a person file must start with ---
    ({"people/x.md": "---\nname: [unclosed\n---\n"}, "broken front matter"),  # YAML error
    ({"people/x.md": "---\nname: X\n- fact\n"}, "not closed"),  # front matter never closed
    ({"people/x.md": "---\n- a list\n---\n"}, "mapping"),  # front matter of the wrong shape
    ({"people/x.md": "---\naliases: [a]\n---\n"}, "name or a relation"),  # nobody named
    ({"notes/x.md": "---\naliases: [a]\n---\ntext"}, "needs a name"),  # a note without a name
    ({"world.md": "- bad <!-- rm {not json} -->\n"}, "world.md:1"),  # a damaged comment names the line
    ({"../escape.md": "- x\n"}, "outside"),  # a path leaving the folder
    ({"/etc/x.md": "- x\n"}, "outside"),  # an absolute path
    ({"people/x.md": "---\nname: X\ncreated_at: yesterday\n---\n"}, "not a time"),  # a bad time
])
def test_bad_files_are_refused_naming_the_file(files: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse(files)


def test_folders_are_written_atomically_and_read_within_limits(tmp_path: Path) -> None:
    files = {"world.md": "- one\n", "people/sarah.md": "---\nname: Sarah\n---\n- two\n"}
    dest = write_dir(files, tmp_path / "export")
    assert read_dir(dest) == files
    with pytest.raises(ValidationError, match="not empty"):
        write_dir(files, dest)
    write_dir({"world.md": "- three\n"}, dest, force=True)  # the old export is moved aside, not deleted
    assert read_dir(dest) == {"world.md": "- three\n"} and len(list(tmp_path.glob("export.before-export-*"))) == 1
    (dest / "bad.md").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValidationError, match="UTF-8"):
        read_dir(dest)
    (dest / "bad.md").unlink()
    (dest / "link.md").symlink_to(dest / "world.md")
    with pytest.raises(ValidationError, match="symlink"):
        read_dir(dest)
