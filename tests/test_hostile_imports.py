"""Import files that did not come from this store (hand-edited, from another tool,
truncated, crafted): each is refused with a ValidationError naming the file and line
(or the markdown file) before anything is written, in bounded memory and time, and a
state no store operation makes is not let in (a memory's link to a person its owner
does not see, which older stores hold, is left out and reported, the memory imported).
The attack's other ~160 crafted files were already refused or harmless (docs/LIMITS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reachy_memory import Config, MemoryStore
from reachy_memory.errors import ReachyMemoryError, ValidationError
from reachy_memory.people.registry import PersonRegistry
from reachy_memory.storage.export import check_entries, person_entries, read_jsonl
from reachy_memory.storage.markdown import parse, read_dir
from tests.conftest import HashEmbedder
from tests.daemon_util import ROOT, DaemonProcess, run_cli

T = "2026-01-01T00:00:00+00:00"


def _fact(**fields: Any) -> dict[str, Any]:
    return {"id": "m1", "content": "Ann likes tea", "type": "fact", "created_at": T} | fields


def _person(**fields: Any) -> dict[str, Any]:
    return {"kind": "person", "id": "p1", "name": "Ann", "created_at": T} | fields


def _write(path: Path, *lines: Any) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8", errors="surrogatepass")
    return path


def _export(store: MemoryStore) -> list[str]:
    """The store's export (JSON Lines), sorted."""
    lines = [json.dumps({"kind": "person", **p}) for p in person_entries(store.people(), store.person_redirects())]
    page, after = store.export_page()
    lines += [json.dumps(m.to_dict()) for m in page]
    while after is not None:
        page, after = store.export_page(after)
        lines += [json.dumps(m.to_dict()) for m in page]
    return sorted(lines)


@pytest.fixture
def store(tmp_path: Path, base_config: Config) -> Any:
    with MemoryStore(config=base_config.replace("memory", path=str(tmp_path / "data")),
                     embedder=HashEmbedder()) as s:
        s.store("Alice likes tea", "fact")
        s.remember("the wifi password is hunter2", name="wifi")
        yield s


def test_a_gigabyte_line_is_refused_without_being_read(tmp_path: Path) -> None:
    """A 1 GB line (a sparse file) was read whole, then decoded (3x its size at the peak):
    now a line over ``max_line_bytes`` is a TooLargeError naming it, in a process whose
    address space is capped at 512 MB."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    code = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from reachy_memory import load_config
        from reachy_memory.storage.export import read_jsonl
        from reachy_memory.errors import TooLargeError
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
        try:
            read_jsonl(Path({str(big)!r}), load_config())
        except TooLargeError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "big.jsonl line 1: longer than" in done.stdout


@pytest.mark.parametrize("line", [
    '{"id": "m1", "content": "tea", "content": "coffee", "created_at": "2026-01-01T00:00:00+00:00"}',
    '{"id": "m1", "content": "tea", "created_at": "2026-01-01T00:00:00+00:00", "metadata": {"a": 1, "a": 2}}',
])
def test_a_key_given_twice_is_refused(tmp_path: Path, base_config: Config, line: str) -> None:
    """json.loads kept the last of two keys silently (another reader keeps the first)."""
    with pytest.raises(ValidationError, match=r"x.jsonl line 1: .*given twice"):
        read_jsonl(_write(tmp_path / "x.jsonl", line), base_config)


@pytest.mark.parametrize("entry", [
    _fact(kind="widget"),  # read as a memory before
    _fact(junk="x" * 1000),  # ignored, but sent to the daemon (a request over its limit)
    _person(content="a memory's field"),
])
def test_a_field_no_export_writes_is_refused(tmp_path: Path, base_config: Config, entry: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"x\.jsonl line 1: fields no export writes"):
        read_jsonl(_write(tmp_path / "x.jsonl", entry), base_config)


@pytest.mark.parametrize(("entry", "field"), [
    (_fact(id="m\ud800"), "id"),  # refused only at the journal write, naming nothing
    (_fact(name="n\ud800"), "name"),
    (_fact(name="n", aliases=["\udc00"]), "aliases"),
    (_fact(subjects=["\ud800"]), "subjects"),
    (_fact(superseded_by="\ud800", superseded_at=T), "superseded_by"),
    (_fact(owner="\ud800"), "owner"),
    (_person(id="p\ud800"), "id"),
    (_person(id="p\n1"), "id"),  # no person operation can name it (read_person_id)
    (_person(id="p" * 300), "id"),
    (_person(merged_ids=["p\x012"]), "merged_ids"),
    (_fact(subjects=[""]), "subjects"),  # and the store's markdown export refused to import it back
    (_fact(subjects=[" p1 "]), "subjects"),
    (_fact(name=" wifi "), "name"),  # remember strips a name: none has whitespace around it
    (_fact(name="   "), "name"),
    (_fact(aliases=["tea"]), "aliases"),  # remember refuses aliases without a name
    (_fact(name="n", aliases=["a" * 300]), "aliases"),
])
def test_labels_no_store_writes_are_refused_naming_line_and_field(tmp_path: Path, base_config: Config,
                                                                   entry: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=r"x\.jsonl line 2: ") as caught:
        read_jsonl(_write(tmp_path / "x.jsonl", _fact(id="ok"), entry), base_config)
    assert caught.value.field == field


def test_a_refused_label_in_a_later_batch_leaves_the_store_as_it_was(store: MemoryStore) -> None:
    """In-process imports go in batches: a lone surrogate in a later batch's id was refused at
    the journal write, after the first batch was stored."""
    before = _export(store)
    memories = [_fact(id=f"m{i}", content=f"fact {i}") for i in range(4)] + [_fact(id="bad\ud800")]
    with pytest.raises(ValidationError, match="memory 4: id is not valid Unicode"):
        store.import_memories(memories, batch=2)
    assert _export(store) == before


def test_many_merged_ids_apply_in_linear_time() -> None:
    """Each redirect-only ``person_merge`` (one per ``merged_ids`` entry of an import, and one
    per redirect replayed at every open) scanned every redirect: 200,000 merged ids did not
    import in 2 minutes, 5,000 took 2 s."""
    registry = PersonRegistry()
    registry.apply({"op": "person_put", "id": "p1", "name": "Ann", "created_at": 1.8e9, "updated_at": 1.8e9})
    start = time.monotonic()
    for i in range(20_000):
        registry.apply({"op": "person_merge", "keep": "p1", "other": f"old{i}", "at": 1.8e9})
    assert time.monotonic() - start < 2.0
    registry.apply({"op": "person_put", "id": "p2", "name": "Bo", "created_at": 1.8e9, "updated_at": 1.8e9})
    registry.apply({"op": "person_merge", "keep": "p2", "other": "p1", "at": 1.8e9})  # a real merge still relinks
    assert {registry.redirects()[f"old{i}"] for i in (0, 19_999)} == {"p2"}


@pytest.mark.parametrize(("text", "message"), [
    ("---\nname: a\x00b\n---\n- x\n", r"people/a.md:2: broken front matter \(the character U\+0000"),  # ReaderError
    ("---\nname: Ann\nname: Bob\n---\n- x\n", "people/a.md:3: the key 'name' is given twice"),
    ("---\nname: Ann\nmetadata: {k: 1, k: 2}\n---\n- x\n", "people/a.md:3: the key 'k' is given twice"),
    # in keys that are none of ours (left out, so checked before they are)
    ("---\nname: Ann\ntags: [a]\ntags: [b]\n---\n- x\n", "people/a.md:4: the key 'tags' is given twice"),
    ("---\nname: Ann\ncssclasses: a\x00b\n---\n- x\n", r"people/a.md:3: broken front matter \(the character U\+0000"),
    ("---\nname: Ann\ntags: !!python/object/apply:os.system [echo]\n---\n- x\n",
     "people/a.md:3: tags: could not determine a constructor"),
    ("---\nname: Ann\na: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n---\n- x\n",
     r"people/a.md:4: b: YAML aliases \(\*name\) are not read"),
    ("---\nname: Ann\nloop: &l [*l]\n---\n- x\n", r"people/a.md:3: loop: YAML aliases"),
    ("---\nname: Ann\nkeywords: " + "[" * 100_000 + "]" * 100_000 + "\n---\n- x\n", "people/a.md: maximum recursion"),
])
def test_markdown_front_matter_faults_are_validation_errors(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "people").mkdir()
    (tmp_path / "people" / "a.md").write_text(text)
    with pytest.raises(ValidationError, match=message):
        parse(read_dir(tmp_path))


def test_a_key_given_twice_in_a_markdown_comment_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"world\.md:1: .*given twice"):
        parse({"world.md": '- tea <!-- rm {"id": "a", "id": "b"} -->\n'})


def test_an_import_refused_mid_way_says_what_was_imported(tmp_path: Path) -> None:
    """A request the daemon refuses (a note name it holds: the file cannot know) after
    earlier requests were stored said only the error."""
    lines = [_fact(id=f"m{i}", content=f"fact number {i}") for i in range(70)]
    lines.append(_fact(id="late", content="another wifi", name="WIFI", created_at="2026-01-02T00:00:00+00:00"))
    with DaemonProcess(tmp_path, embedding={"enabled": False}) as daemon:
        with daemon.client() as c:
            c.remember("the wifi password is hunter2", name="wifi")
        done = run_cli(daemon, "import", str(_write(tmp_path / "x.jsonl", *lines)))
    assert done.returncode == 2, done.stderr
    assert "imported 0 people and 64 memories before the error" in done.stderr
    assert "already used by memory" in done.stderr and "Traceback" not in done.stderr


_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6),
                  st.sampled_from(["", " x", "\x00", "\ud800", "1999-01-01T00:00:00", "9999-12-31"]))
_VALUE = st.recursive(_LEAF, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c,
                                                                                          max_size=3)), max_leaves=5)
_FIELDS = ["id", "content", "type", "created_at", "expires_at", "metadata", "subjects", "owner", "shared", "name",
           "aliases", "superseded_at", "superseded_by", "protected", "covers_until", "kind", "merged_ids"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(edits=st.lists(st.tuples(st.integers(0, 99), st.sampled_from(_FIELDS), st.one_of(_VALUE, st.just(...))),
                      min_size=1, max_size=3))
def test_an_edited_export_is_refused_whole_or_imports_a_store_that_reopens_and_round_trips(
        tmp_path_factory: pytest.TempPathFactory, base_config: Config,
        edits: list[tuple[int, str, Any]]) -> None:
    """Random field edits of a real export (``...``: the field removed), imported over the
    store it came from: refused with our error and nothing changed, or imported; either way
    the store reopens to what it held and its own export imports back exactly."""
    root = tmp_path_factory.mktemp("edit")
    config = base_config.replace("memory", path=str(root / "data"))
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        ann = s.add_person("Ann", relation="friend", aliases=["Annie"])
        s.merge_people(ann.id, s.add_person("Anne").id)
        s.remember(facts=[{"content": "Ann likes tea", "subjects": [ann.id]}])
        s.remember("the wifi password is hunter2", name="wifi", aliases=["wlan"])
        s.record_turn("user", "hello robot")
        s.supersede(s.store("the code is 1", "fact").id, s.store("the code is 2", "fact").id)
        entries = [json.loads(x) for x in _export(s)]
        for n, field, value in edits:
            entry = entries[n % len(entries)]
            entry.pop(field, None) if value is ... else entry.update({field: value})
        before = _export(s)
        try:
            s.import_memories(*read_jsonl(_write(root / "x.jsonl", *entries), config))
        except ReachyMemoryError:
            assert _export(s) == before
        after = _export(s)
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        assert _export(s) == after
    fresh = base_config.replace("memory", path=str(root / "fresh"))
    with MemoryStore(config=fresh, embedder=HashEmbedder()) as t:
        t.import_memories(*read_jsonl(_write(root / "y.jsonl", *after), fresh))
        assert _export(t) == after


def test_max_line_bytes_fits_the_largest_entry_a_store_writes(tmp_path: Path, base_config: Config) -> None:
    """The line limit refuses nothing a store exports: content of max_content_chars astral
    characters written ASCII-escaped, metadata at its packed limit."""
    config = base_config.replace("memory", path=str(tmp_path / "data"))
    text = "\U0001f600" * config.memory.max_content_chars
    meta = {"k": "\x01" * (config.memory.max_metadata_bytes - 8)}  # 6 bytes each as JSON
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        s.store(text, "fact", metadata=meta)
        entry = s.export_page()[0][0].to_dict()
    path = _write(tmp_path / "x.jsonl", json.dumps(entry, ensure_ascii=True))
    assert read_jsonl(path, config)[0][0]["content"] == text


@pytest.mark.parametrize(("call", "field"), [
    (lambda s: s.import_memories(iter([_fact()])), None),  # checked, then nothing left to import: 0 imported
    (lambda s: s.import_memories(None), "memories"),  # TypeError
    (lambda s: s.import_memories([_fact()], batch=0), "batch"),  # ValueError from range()
    (lambda s: s.import_memories([_fact()], batch=-1), "batch"),  # imported nothing, said 0
])
def test_in_process_import_arguments(store: MemoryStore, call: Any, field: str | None) -> None:
    """``import_memories`` read an iterator twice (checked, then empty: nothing imported, no
    error) and took ``batch`` 0 (ValueError) or -1 (nothing imported, no error)."""
    if field is None:
        assert call(store) == {"people": 0, "memories": 1, "links_left_out": 0, "left_out_links": []}
        return
    with pytest.raises(ValidationError) as caught:
        call(store)
    assert caught.value.field == field


def test_supersession_loops_through_stored_memories_are_refused(store: MemoryStore) -> None:
    """A stored A superseded by B, B forgotten since (A is left pointing at it); an import of
    B superseded by A closed the loop: both hidden, and the store's own export was then
    refused by import as a loop."""
    a, b = store.store("the door code is 1234", "fact"), store.store("the door code is 5678", "fact")
    store.supersede(a.id, b.id)
    store.forget(b.id)
    before = _export(store)
    with pytest.raises(ValidationError, match="loop through stored memories") as caught:
        store.import_memories([_fact(id=b.id, superseded_by=a.id, superseded_at=T)])
    assert caught.value.field == "superseded_by" and _export(store) == before


# (the person, the memory about it by id): a memory about a person its owner does not see
# (an unscoped memory is seen by every user: it may be about household persons only).
UNSEEN_SUBJECTS = [
    (_person(owner="alice"), _fact(subjects=["p1"])),  # unscoped
    (_person(owner="alice"), _fact(subjects=["p1"], owner="bob")),  # another user's
    (_person(owner="alice", merged_ids=["p0"]), _fact(subjects=["p0"], shared=True)),  # through an old id
]


def _left_out(*links: tuple[str, str]) -> list[dict[str, str]]:
    return [{"memory_id": m, "person_id": p} for m, p in links]


NOTHING = {"people": 0, "memories": 0, "links_left_out": 0, "left_out_links": []}


@pytest.mark.parametrize(("person", "memory"), UNSEEN_SUBJECTS)
def test_a_memory_about_a_person_its_owner_does_not_see_imports_without_that_link(
        tmp_path: Path, base_config: Config, store: MemoryStore, person: dict[str, Any],
        memory: dict[str, Any]) -> None:
    """A store written before remember kept a memory's persons to ones its owner sees (an
    unscoped fact said while the tools were unbound linked Alice's person by name), or an
    edited file: the link was let in (an unscoped fact about Alice's person, seen by Bob).
    Now the file reads (JSON Lines, a markdown folder's entries), the memory is imported
    about the other person it names, the link left out is reported, and the same import
    again changes nothing and reports nothing."""
    memory = memory | {"subjects": [*memory["subjects"], "p2"]}
    lines = (person, _person(id="p2", name="Bo"), memory)
    memories, people = read_jsonl(_write(tmp_path / "x.jsonl", *lines), base_config)
    check_entries(memories, people, "people", base_config)  # a markdown folder's entries
    got = store.import_memories(memories, people)
    assert store.get("m1").subjects == ("p2",)  # type: ignore[union-attr]
    assert got == {"people": 2, "memories": 1, "links_left_out": 1, "left_out_links": _left_out(("m1", "p1"))}
    after = _export(store)
    assert store.import_memories(memories, people) == NOTHING and _export(store) == after


def test_an_in_process_import_leaves_out_the_unseen_links_of_every_batch(store: MemoryStore) -> None:
    """In batches (one memory each): every memory imported, each unseen link left out and
    listed in import order, the memory about nobody when it named no one else."""
    owners = ["alice", None, "bob", "alice"]
    memories = [_fact(id=f"m{i}", content=f"fact {i}", subjects=["p1"], owner=o) for i, o in enumerate(owners)]
    got = store.import_memories(memories, [_person(owner="alice")], batch=1)
    assert [store.get(f"m{i}").subjects for i in range(4)] == [("p1",), (), (), ("p1",)]  # type: ignore[union-attr]
    assert got == {"people": 1, "memories": 4, "links_left_out": 2,
                   "left_out_links": _left_out(("m1", "p1"), ("m2", "p1"))}


def test_an_import_about_a_stored_person_is_decided_with_the_person_as_stored_at_commit(store: MemoryStore) -> None:
    """The store keeps a stored person as it is (owner included): a file giving Alice's
    person as the household's, or naming only its id, links no unscoped memory to her.
    The daemon's two halves of an import agree: the commit decides, with the owner as
    it is then (changed after prepare_import either way)."""
    carol = store.add_person("Carol", owner="alice")
    as_household = {**carol.to_dict(), "owner": None}
    for n, people in enumerate(([as_household], [])):
        got = store.import_memories([_fact(id=f"c{n}", subjects=[carol.id])], people)
        assert store.get(f"c{n}").subjects == ()  # type: ignore[union-attr]
        assert got == {"people": 0, "memories": 1, "links_left_out": 1,
                       "left_out_links": _left_out((f"c{n}", carol.id))}
    assert store.find_person(carol.id).owner == "alice"  # type: ignore[union-attr]
    dan, eve = store.add_person("Dan"), store.add_person("Eve", owner="alice")
    prepared = store.prepare_import([_fact(id="m2", subjects=[dan.id]), _fact(id="m3", subjects=[eve.id])])
    store.update_person(dan.id, owner="alice")  # allowed: no stored memory is about him
    store.update_person(eve.id, owner=None)  # to the household: always allowed
    assert store.commit_import(prepared)["left_out_links"] == _left_out(("m2", dan.id))
    assert (store.get("m2").subjects, store.get("m3").subjects) == ((), (eve.id,))  # type: ignore[union-attr]


def test_an_export_of_a_store_with_owners_imports(tmp_path: Path, base_config: Config) -> None:
    """Persons of two users and the household, memories of each about persons they see."""
    config = base_config.replace("memory", path=str(tmp_path / "data"))
    with MemoryStore(config=config, embedder=HashEmbedder()) as s:
        ann, bo = s.add_person("Ann"), s.add_person("Bo", owner="alice")
        s.remember("Ann likes tea", subjects=[ann.id])
        s.remember("Ann likes jam", subjects=[ann.id], owner="bob")
        s.remember("Bo and Ann cook", subjects=[bo.id, ann.id], owner="alice", shared=True)
        s.merge_people(bo.id, s.add_person("Bob", owner="alice").id)
        lines = _export(s)
    fresh = base_config.replace("memory", path=str(tmp_path / "fresh"))
    with MemoryStore(config=fresh, embedder=HashEmbedder()) as t:
        assert t.import_memories(*read_jsonl(_write(tmp_path / "x.jsonl", *lines), fresh)) == {
            "people": 2, "memories": 3, "links_left_out": 0, "left_out_links": []}
        assert _export(t) == lines
