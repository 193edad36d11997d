"""Markdown export and import (``_markdown``, spec 003): exact round trips, hand-written
files, hostile input, safe folders."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from reachy_memory import ValidationError
from reachy_memory.storage.markdown import parse, read_dir, render, write_dir

TIMES = st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2199, 1, 1), timezones=st.just(UTC)).map(
    lambda d: d.replace(microsecond=0).isoformat())
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40).filter(str.strip)
# Every character str.splitlines() breaks at, and some a markdown or YAML reader might trip on.
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
LINE_TEXT = st.text(st.sampled_from(BREAKS + "a -~<!>:[]#`\t\ufeffé"), min_size=1, max_size=20).filter(str.strip)
NAME_TEXT = st.sampled_from(["Ann\u2028e", "Zo\u2029ë", "yes", "17", "- x", "---"])  # names allow no Cc


@st.composite
def stores(draw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n_people = draw(st.integers(0, 3))
    people = [{"id": f"p{i:031d}", "name": draw(st.one_of(st.sampled_from(["Sarah", "sarah", "John", "", "Zoë"]),
                                                            NAME_TEXT)),
               "relation": draw(st.sampled_from([None, "wife", "son"])),
               "aliases": draw(st.lists(st.one_of(st.sampled_from(["Sassy", "J"]), NAME_TEXT), max_size=2,
                                        unique=True)),
               "owner": draw(st.sampled_from([None, "alex"])), "external_id": draw(st.sampled_from([None, "17"])),
               "metadata": draw(st.sampled_from([{}, {"note": "a\u2028b\x85c\r\nd"}])),
               "created_at": draw(TIMES), "updated_at": draw(TIMES)} for i in range(n_people)]
    for i, p in enumerate(people):
        if not p["name"] and not p["relation"]:
            p["relation"] = "friend"
        # ids merged into the person (kept as written: "017" is not the number 17)
        p["merged_ids"] = draw(st.lists(st.sampled_from([f"gone{i}", f"0{i}7", f"yes{i}"]), max_size=2, unique=True))
        if p["aliases"] and draw(st.booleans()):  # one list object twice in the front matter (YAML would alias it)
            p["metadata"] = {"aka": p["aliases"], "also": p["aliases"]}
    memories = []
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["fact", "fact", "conversation", "context"]))
        subjects = draw(st.lists(st.sampled_from([p["id"] for p in people]), max_size=2, unique=True)) if people else []
        memory = {"id": f"m{i:031d}", "content": draw(st.one_of(TEXT, LINE_TEXT, st.just("two\nlines"),
                                                                  st.just("~~x~~"), st.just("a\r\nb\r\n"))),
                  "type": kind, "created_at": draw(TIMES), "expires_at": None,
                  "metadata": draw(st.one_of(st.sampled_from([{}, {"role": "user"}, {"n": 1, "tags": ["a", "b"]}]),
                                             st.builds(lambda t: {"said": t, "tags": [t]}, LINE_TEXT))),
                  "subjects": subjects, "owner": draw(st.sampled_from([None, "alex"])),
                  "shared": draw(st.booleans()), "name": None, "aliases": [], "superseded_at": None,
                  "superseded_by": None, "protected": draw(st.booleans()), "covers_until": None}
        if kind == "fact" and draw(st.booleans()) and i == 0:
            memory |= {"name": draw(st.sampled_from(["plant care", "wifi", "plant\u2028care", "yes"])),
                       "aliases": draw(st.sampled_from([["ferns"], ["f\u2029erns", "17"]]))}
        if i > 0 and draw(st.booleans()):
            memory |= {"superseded_by": memories[-1]["id"], "superseded_at": draw(TIMES)}
        memories.append(memory)
    return memories, people


def _yaml_anchors(files: dict[str, str]) -> list[tuple[str, str]]:
    """(file, anchor) for each YAML anchor or alias (``&id001``, ``*id001``) in the files'
    front matter: Obsidian shows them raw, and other tools read them differently or not at all."""
    found = []
    for path, text in files.items():
        if text.startswith("---\n"):
            front = text[4:text.index("\n---\n", 3)]
            found += [(path, str(e.anchor)) for e in yaml.parse(front, Loader=yaml.SafeLoader)
                      if getattr(e, "anchor", None) is not None]
    return found


def _clean(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records compared field by field, defaults dropped (they are left out of the files)."""
    return sorted(({k: v for k, v in d.items() if v not in (None, [], {}, False)} for d in items),
                  key=lambda d: d["id"])


@settings(max_examples=150, deadline=None)
@given(stores())
def test_render_then_parse_gives_back_every_memory_and_person(data: tuple[list[dict[str, Any]], ...]) -> None:
    memories, people = data
    files = render(memories, people)
    assert _yaml_anchors(files) == []  # an object met twice is written out twice, never aliased
    ignored: dict[str, list[str]] = {}
    got_memories, got_people = parse(files, ignored=ignored)
    assert ignored == {}  # our own front matter: every key ours
    assert _clean(got_people) == _clean(people)
    assert _clean(got_memories) == _clean(memories)
    for path, text in files.items():  # a list file has no line end str.splitlines() sees and parse does not
        if not path.startswith("notes/"):
            assert text.splitlines() == text.split("\n")[:-1], path


def test_a_named_note_and_a_person_sharing_a_list_are_written_without_yaml_aliases() -> None:
    """A note's front matter holds its ``aliases`` list twice (top level, where Obsidian reads
    it, and in ``rm``), and PyYAML wrote the second as an alias of the first: ``aliases: &id001``
    ... ``aliases: *id001``, shown raw in Obsidian and read differently by other tools."""
    aliases = ["router", "ssid"]
    note = {"id": "m1", "content": "The password is on the fridge.", "type": "fact",
            "created_at": "2026-11-02T10:00:00+00:00", "metadata": {}, "subjects": [], "name": "wifi",
            "aliases": aliases}
    person = {"id": "p1", "name": "Sarah", "relation": None, "aliases": ["Sassy"], "owner": None,
              "external_id": None, "metadata": {"aka": aliases, "also": aliases},
              "created_at": "2026-11-01T10:00:00+00:00", "updated_at": "2026-11-01T10:00:00+00:00"}
    files = render([note], [person])
    assert _yaml_anchors(files) == [] and not re.search(r"[&*]id\d", "".join(files.values()))
    assert files["notes/wifi.md"].count("- router\n") == 2  # written out in full both times
    memories, people = parse(files)
    assert (_clean(memories), _clean(people)) == (_clean([note]), _clean([person]))


def test_a_line_separator_in_a_record_keeps_it_whole() -> None:
    memory = {"id": "m1", "content": "tea\u2028or\x85coffee\u2029?", "type": "fact",
              "created_at": "2026-11-02T10:00:00+00:00", "metadata": {"said": "a\u2028b"}, "subjects": []}
    files = render([memory], [])
    assert "\u2028" not in files["world.md"] and "\x85" not in files["world.md"]
    got, _ = parse(files)
    assert _clean(got) == _clean([memory])  # one record, the same id: no junk hand-written one
    assert parse(files)[0] == got  # a re-import adds nothing


def test_hand_written_lines_end_only_at_newlines() -> None:
    files = {"world.md": "- one\u2028two\x85three\r\n- four\r- five\n"}
    assert [m["content"] for m in parse(files)[0]] == ["one\u2028two\x85three", "four", "five"]


def test_hand_written_files_become_sensible_records() -> None:
    files = {
        "people/sarah.md": "---\nname: Sarah\nrelation: wife\naliases: [Sassy]\n---\n- likes Italian food\n"
                           "- plays the cello\nnot a list line\n",
        "world.md": "# World\n\n- The wifi password is on the fridge\n",
        "daily/2026-11-02.md": "- 14:05 user: shall we go to the park?\n- 14:06 assistant: yes!\n- no time\n",
        "notes/plants.md": "---\nname: plant care\naliases: [ferns]\n---\nWater the ferns on Sundays.\n",
    }
    memories, people = parse(files, now="2026-11-22T10:00:00+00:00")
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
    ({"notes/x.md": "---\nname: ' '\naliases: [a]\n---\ntext"}, "name must be text"),  # a blank name
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


@pytest.mark.parametrize(("files", "want"), [
    # a YAML string is one alias, not its letters
    ({"people/ann.md": "---\nname: Ann\naliases: Annie\n---\n"}, ("Ann", None, ["Annie"], None)),
    # YAML reads yes as true: the name is the text as written
    ({"people/x.md": "---\nname: yes\n---\n"}, ("yes", None, [], None)),
    # a number as written, leading zero kept; aliases of other YAML types too
    ({"people/x.md": "---\nname: 007\nexternal_id: 17\naliases: [no, 1.50]\n---\n"},
     ("007", None, ["no", "1.50"], "17")),
    # a date-like relation and a null alias list
    ({"people/x.md": "---\nrelation: 2026-01-01\naliases:\n---\n"}, ("", "2026-01-01", [], None)),
])
def test_front_matter_text_is_taken_as_written(files: dict[str, str], want: tuple[Any, ...]) -> None:
    _, [person] = parse(files)
    assert (person["name"], person["relation"], person["aliases"], person["external_id"]) == want


def test_a_note_alias_written_as_a_string_is_one_alias() -> None:
    [note], _ = parse({"notes/wifi.md": "---\nname: yes\naliases: router\n---\nThe password is on the fridge.\n"})
    assert (note["name"], note["aliases"]) == ("yes", ["router"])


HAND = {
    "people/sarah.md": "---\nname: Sarah\n---\n- likes tea\n- likes tea\n- plays the cello\n",
    "world.md": "- The wifi password is on the fridge\n",
    "daily/2026-11-02.md": "- 14:05 user: hello\n",
    "notes/plants.md": "---\nname: plant care\n---\nWater the ferns.\n",
}


def test_re_importing_a_hand_written_folder_gives_the_same_ids() -> None:
    first = parse(HAND, now="2026-11-22T10:00:00+00:00")
    assert parse(HAND, now="2026-11-23T10:00:00+00:00")[0] == [  # the time of import is not in the ids
        m | {"created_at": "2026-11-23T10:00:00+00:00"} if m["created_at"].startswith("2026-11-22") else m
        for m in first[0]]
    assert [p["id"] for p in parse(HAND)[1]] == [p["id"] for p in first[1]]
    ids = [m["id"] for m in first[0]]
    assert len(set(ids)) == len(ids) == 6  # the same line twice is two records, as written


def test_an_edited_line_imports_as_a_new_record() -> None:
    before = {m["content"]: m["id"] for m in parse(HAND)[0]}
    edited = HAND | {"people/sarah.md": "---\nname: Sarah\n---\n- likes tea\n- likes tea\n- plays the piano\n"}
    after = {m["content"]: m["id"] for m in parse(edited)[0]}
    assert after["likes tea"] == before["likes tea"] and after["plays the piano"] not in before.values()
    renamed = parse(HAND | {"people/sarah.md": "---\nname: Sara\n---\n- likes tea\n"})
    assert renamed[1][0]["id"] != parse(HAND)[1][0]["id"]  # another person, with her own facts
    assert parse(HAND | {"notes/plants.md": "---\nname: plant care\n---\nWater the ferns weekly.\n"})[0] != \
        parse(HAND)[0]


@pytest.mark.parametrize(("files", "where", "message"), [
    # a YAML date that does not exist
    ({"people/x.md": "---\nname: X\ncreated_at: 2026-02-30\n---\n"}, "people/x.md:3", "day is out of range"),
    # metadata of the wrong shape
    ({"people/x.md": "---\nname: X\nmetadata: [a, b]\n---\n"}, "people/x.md", "metadata must be a dict"),
    # a note with an empty body
    ({"notes/x.md": "---\nname: X\n---\n\n  \n"}, "notes/x.md", "needs some text"),
    # a 5,000-digit number in front matter (in a comment it was refused before too)
    ({"people/x.md": "---\nname: X\nmetadata:\n  n: " + "1" * 5000 + "\n---\n"}, "people/x.md:4", "digits"),
    ({"world.md": "# w\n- x <!-- rm {\"n\": " + "1" * 5000 + "} -->\n"}, "world.md:2", "digits"),
    # a daily file not named by a date (was "created_at 'monday.mdT10:00:00+00:00'"), or by no real one
    ({"daily/monday.md": "- 10:00 hi\n"}, "daily/monday.md", "named by an existing date"),
    ({"daily/2026-02-30.md": "- 10:00 hi\n"}, "daily/2026-02-30.md", "named by an existing date"),
    # an hour of 25
    ({"daily/2026-11-02.md": "- 10:00 hi\n- 25:00 late\n"}, "daily/2026-11-02.md:2", "25:00 is not a time"),
    # an unknown type, in a comment and in a hand-written daily line
    ({"world.md": "- x  <!-- rm {\"id\": \"a\", \"type\": \"bogus\"} -->\n"}, "world.md:1", "bogus"),
    ({"daily/2026-11-02.md": "- [bogus] x\n"}, "daily/2026-11-02.md:1", "bogus"),
    # fields of the wrong type or unknown in a comment
    ({"world.md": "- x  <!-- rm {\"id\": \"a\", \"subjects\": \"p1\"} -->\n"}, "world.md:1", "subjects"),
    ({"world.md": "- x  <!-- rm {\"id\": 7} -->\n"}, "world.md:1", "id must be text"),
    ({"world.md": "- x  <!-- rm {\"id\": \"a\", \"colour\": 1} -->\n"}, "world.md:1", "unknown fields"),
    ({"world.md": "- x  <!-- rm {\"created_at\": \"1900-01-01T00:00:00\"} -->\n"}, "world.md:1", "outside"),
    # the same id twice
    ({"world.md": "- x  <!-- rm {\"id\": \"a\"} -->\n", "daily/2026-11-02.md": "- y  <!-- rm {\"id\": \"a\"} -->\n"},
     "world.md", "given twice (also in daily/2026-11-02.md)"),
    # a name YAML reads as a list, a front matter key we leave out with a YAML tag, a person's metadata of
    # the wrong type
    ({"people/x.md": "---\nname: [a, b]\n---\n"}, "people/x.md:2", "name must be text"),
    ({"people/x.md": "---\nname: X\nbirthday: !!python/name:os.system\n---\n"}, "people/x.md:3",
     "birthday: could not determine a constructor"),
    ({"people/x.md": "---\nname: X\nmetadata: {a: {b: 1}}\n---\n"}, "people/x.md", "metadata"),
    # a lone surrogate given to parse
    ({"world.md": "- a\ud800b\n"}, "world.md:1", "surrogate"),
    # a note's rm that is not a mapping
    ({"notes/x.md": "---\nname: X\nrm: 3\n---\ntext\n"}, "notes/x.md", "rm must be a mapping"),
])
def test_bad_input_is_a_validation_error_naming_file_and_line(files: dict[str, str], where: str,
                                                             message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)) as caught:
        parse(files)
    assert str(caught.value).startswith(f"{where}: ")


def test_list_items_bom_fences_and_roles_as_written_by_hand() -> None:
    files = {
        "world.md": "\ufeff- first line\n* star\n+ plus\n-\ttab\n1. numbered\n2) also\n  - indented, ignored\n"
                    "```\n- in a fence, ignored\n```\n~~~~md\n- also ignored\n```\n~~~~\n-no space, ignored\n",
        "daily/2026-11-02.md": "- Remember: buy milk\n- 09:30 Assistant: good morning\n- [context] cooking\n",
        "people/ann.MD": "\ufeff---\nname: Ann\n---",  # a BOM before the front matter, no final newline
    }
    memories, people = parse(files)
    facts = [m["content"] for m in memories if m["type"] == "fact"]
    assert facts == ["first line", "star", "plus", "tab", "numbered", "also"]
    turns = {m["content"]: m for m in memories if m["type"] != "fact"}
    assert turns["Remember: buy milk"]["metadata"] == {}  # not a role
    assert turns["good morning"]["metadata"] == {"role": "assistant"}
    assert turns["cooking"]["type"] == "context"
    assert [p["name"] for p in people] == ["Ann"]


def test_crlf_files_and_note_bodies_keep_their_line_ends(tmp_path: Path) -> None:
    note = {"id": "n1", "content": "line one\r\nline two\r\n", "type": "fact", "name": "crlf",
            "created_at": "2026-11-02T10:00:00+00:00", "metadata": {}, "subjects": []}
    dest = write_dir(render([note], []) | {"people/bob.md": "---\r\nname: Bob\r\n---\r\n- likes jazz\r\n"},
                     tmp_path / "export")
    memories, people = parse(read_dir(dest))
    assert {m["content"] for m in memories} == {"line one\r\nline two\r\n", "likes jazz"}
    assert [p["name"] for p in people] == ["Bob"]


def test_hidden_files_and_folders_are_skipped(tmp_path: Path) -> None:
    for rel in (".trash/old.md", "._ann.md", ".#ann.md", "people/._x.md", "world.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"\xff\xfe junk" if rel != "world.md" else b"- one\n")
    assert read_dir(tmp_path) == {"world.md": "- one\n"}
    assert parse({".trash/people/x.md": "junk", "world.md": "- one\n"})[0][0]["content"] == "one"


def test_upper_case_md_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "WORLD.MD").write_text("- one\n")
    assert [m["content"] for m in parse(read_dir(tmp_path))[0]] == ["one"]


def test_the_symlink_check_looks_in_the_export_folder_not_the_cwd(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    export = tmp_path / "export"
    (export / "people").mkdir(parents=True)
    (export / "people" / "ann.md").write_text("---\nname: Ann\n---\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "people").symlink_to(export / "people")
    monkeypatch.chdir(cwd)
    assert list(read_dir(export)) == ["people/ann.md"]


def test_symlinked_folders_and_special_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "ann.md").write_text("---\nname: Ann\n---\n")
    export = tmp_path / "export"
    export.mkdir()
    (export / "people").symlink_to(other)
    with pytest.raises(ValidationError, match=r"^people: symlinks are not followed"):
        read_dir(export)
    (export / "people").unlink()
    os.mkfifo(export / "x.md")  # reading it would wait for a writer forever
    with pytest.raises(ValidationError, match=r"^x.md: not a regular file"):
        read_dir(export)


def test_a_file_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / os.fsdecode(b"bad\xff.md")).write_text("- x\n")
    with pytest.raises(ValidationError, match="not valid Unicode"):
        read_dir(tmp_path)


@pytest.mark.parametrize("content", [
    "<!-- rm {} --> #0",  # a text that looks like the comment (the whole import failed)
    'see <!-- rm {"type": "context"} --> here',  # one that would parse, mid-line
    "a < b and c <!-- d",  # a bare "<" and an opening comment
])
def test_a_text_holding_the_comment_marker_round_trips(content: str) -> None:
    memory = {"id": "m1", "content": content, "type": "fact", "created_at": "2026-01-01T00:00:00+00:00"}
    memories, _ = parse(render([memory], []))
    assert [(m["id"], m["content"], m["type"]) for m in memories] == [("m1", content, "fact")]


def test_an_older_export_with_a_raw_marker_in_its_comment_still_reads() -> None:
    # Before "<" was escaped in the comment, a text holding "<!-- rm {" sat raw inside its JSON.
    line = '- x  <!-- rm {"content": "<!-- rm {} --> x", "created_at": "2026-01-01T00:00:00+00:00", "id": "m1"} -->'
    memories, _ = parse({"world.md": "# World\n\n" + line + "\n"})
    assert [(m["id"], m["content"]) for m in memories] == [("m1", "<!-- rm {} --> x")]


OBSIDIAN = {  # notes as Obsidian writes them: its properties, tags, wikilinks; daily notes by date
    "notes/Wifi.md": "---\ntags:\n  - home\n  - network\naliases:\n  - router\ncssclasses: [wide]\n"
                     "created: 2026-11-01T09:12\n---\nThe password is on the fridge, see [[Kitchen]].\n",
    "notes/Plants.md": "Water the ferns on Sundays. #garden\n",  # no properties at all
    "people/Sarah.md": "---\nname: Sarah\naliases: [Sassy]\ntags: [person]\npublish: false\n---\n"
                       "- likes Italian food\n",
    "daily/2026-11-02.md": "---\ntags: [daily]\nmood: 7\n---\n- 14:05 user: shall we go to the park?\n",
    "world.md": "---\nup: \"[[Home]]\"\n---\n- The bins go out on Monday\n",
}


def test_an_obsidian_vault_imports_and_says_which_keys_it_left_out() -> None:
    """Any front matter key that was not ours refused the whole folder ("unknown key 'tags'"),
    and a note had to have a ``name``: an Obsidian vault could not be imported at all."""
    ignored: dict[str, list[str]] = {}
    memories, people = parse(OBSIDIAN, now="2026-11-22T10:00:00+00:00", ignored=ignored)
    assert ignored == {"notes/Wifi.md": ["tags", "cssclasses", "created"], "people/Sarah.md": ["tags", "publish"],
                       "daily/2026-11-02.md": ["tags", "mood"], "world.md": ["up"]}
    notes = {m["name"]: m for m in memories if m.get("name")}
    assert notes["Wifi"]["aliases"] == ["router"]  # Obsidian's aliases are our note aliases
    assert notes["Wifi"]["content"] == "The password is on the fridge, see [[Kitchen]]."
    assert notes["Plants"]["content"] == "Water the ferns on Sundays. #garden"  # named by its file, as Obsidian does
    assert [(p["name"], p["aliases"]) for p in people] == [("Sarah", ["Sassy"])]
    facts = sorted(m["content"] for m in memories if not m.get("name"))
    assert facts == ["The bins go out on Monday", "likes Italian food", "shall we go to the park?"]
    assert parse(OBSIDIAN, now="2026-11-22T10:00:00+00:00") == (memories, people)  # the same ids again


@pytest.mark.parametrize(("files", "first", "second"), [
    ({"notes/a/Ideas.md": "one\n", "notes/b/Ideas.md": "two\n"}, "notes/a/Ideas.md", "notes/b/Ideas.md"),
    ({"notes/Ideas.md": "one\n", "notes/ideas.md": "two\n"}, "notes/Ideas.md", "notes/ideas.md"),
    ({"notes/Ideas.md": "one\n", "notes/x.md": "---\naliases: [IDEAS]\n---\ntwo\n"}, "notes/Ideas.md", "notes/x.md"),
])
def test_notes_named_alike_by_their_files_are_refused_naming_both_files(files: dict[str, str], first: str,
                                                                          second: str) -> None:
    """An Obsidian vault names notes by their files, and keeps the same file name in two
    folders: the import refused it naming two memory ids, which no one can find in a vault."""
    with pytest.raises(ValidationError, match=rf"^{re.escape(second)}: the note name or alias .* is also "
                                              rf"{re.escape(first)}'s"):
        parse(files, now="2026-11-22T10:00:00+00:00")
    parse({first: files[first], second: "---\nname: Other\n---\ntwo\n"}, now="2026-11-22T10:00:00+00:00")


def test_a_note_named_by_a_decomposed_file_name_gets_the_composed_name() -> None:
    """A vault written on a Mac has decomposed file names ("Cafe" + U+0301): the note was named
    so, and neither ``note("Café")`` typed on a keyboard nor a note "Café" beside it matched it."""
    decomposed = "Cafe\u0301"
    memories, _ = parse({f"notes/{decomposed}.md": "Open 8 to 18.\n"}, now="2026-11-22T10:00:00+00:00")
    assert [m["name"] for m in memories] == ["Caf\u00e9"]
    with pytest.raises(ValidationError, match="is also"):
        parse({f"notes/{decomposed}.md": "one\n", "notes/x/Caf\u00e9.md": "two\n"}, now="2026-11-22T10:00:00+00:00")
