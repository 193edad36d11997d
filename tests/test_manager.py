"""Spec 000's ``MemoryManager``, called the way the spec's own code calls it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from reachy_memory import Config, MemoryManager, MemoryStore, MemoryType, StoreLockedError
from reachy_memory.embedding.embedder import OnnxEmbedder


class ReachyAgentLoop:
    """Spec 000's agent loop with the LLM call replaced by an echo: sync window calls
    around an async turn."""

    def __init__(self, memory: MemoryManager) -> None:
        self._memory = memory
        self.prompts: list[list[dict[str, str]]] = []

    async def process(self, user_input: str) -> str:
        self._memory.add_to_context_window("user", user_input)
        context = self._memory.get_context_window()
        self.prompts.append([{"role": c["role"], "content": c["content"]} for c in context[:-1]])
        await asyncio.sleep(0)  # the LLM call
        reply = f"you said {user_input}"
        self._memory.add_to_context_window("assistant", reply)
        return reply


def manager(config: Config, embedder: Any, window: int = 5) -> MemoryManager:
    return MemoryManager(config.memory.path, window, config=config, embedder=embedder)


def test_the_spec_agent_loop_and_profile_facts_run_unchanged(config: Config, embedder: OnnxEmbedder) -> None:
    async def session() -> tuple[list[Any], list[Any], ReachyAgentLoop]:
        async with manager(config, embedder, window=2) as memory:
            loop = ReachyAgentLoop(memory)
            for text in ("hello", "I like jazz", "what time is it?"):
                await loop.process(text)
            await memory.store("User prefers to be called Alex", MemoryType.FACT,
                               {"category": "user_profile", "field": "name"})
            await memory.remember_fact("User is interested in robotics and AI", category="user_profile")
            await memory.remember_conversation("We talked about jazz", person="Alex")
            await memory.set_context("current_task", "tidying the kitchen")
            profile = await memory.search("user preferences", memory_type=MemoryType.FACT)
            window = memory.get_context_window()
            assert await memory.get_context("current_task") == "tidying the kitchen"
            assert await memory.get_context("nothing") is None
            assert await memory.forget(profile[0].memory.id) is True
            assert await memory.forget(profile[0].memory.id) is False
            assert await memory.cleanup_expired() == 0
            memory.clear_context_window()
            assert memory.get_context_window() == []
            return profile, window, loop

    profile, window, loop = asyncio.run(session())
    assert {r.memory.metadata.get("category") for r in profile} == {"user_profile"} and len(profile) == 2
    assert [m["content"] for m in window] == ["I like jazz", "you said I like jazz", "what time is it?",
                                              "you said what time is it?"]  # the last 2 turns
    assert loop.prompts[1] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "you said hello"}]


def test_persist_path_and_window_size_are_the_manager_s(tmp_path: Path, config: Config,
                                                          embedder: OnnxEmbedder) -> None:
    path = tmp_path / "elsewhere"
    with MemoryManager(path, 1, config=config, embedder=embedder) as memory:
        for i in range(3):
            memory.add_to_context_window("user", f"turn {i}")
        asyncio.run(memory.remember_fact("kept in the manager's directory"))
        assert [m["content"] for m in memory.get_context_window()] == ["turn 1", "turn 2"]  # 1 turn, 2 messages
        with pytest.raises(StoreLockedError):  # the directory has one owner
            MemoryStore(config=config.replace("memory", path=str(path)), embedder=None)
    with MemoryStore(config=config.replace("memory", path=str(path)), embedder=embedder) as store:
        assert [h.memory.content for h in store.search("manager's directory")] == ["kept in the manager's directory"]
    memory.close()  # idempotent


def test_without_a_path_the_config_s_directory_is_used(config: Config, embedder: OnnxEmbedder) -> None:
    # MemoryManager(config=cfg) replaced cfg's memory.path with ~/.reachy/memory
    with MemoryManager(config=config.replace("memory", context_window_size=1), embedder=embedder) as memory:
        assert memory.memory_store.path == config.data_dir
        for i in range(3):
            memory.add_to_context_window("user", f"turn {i}")
        assert len(memory.get_context_window()) == 2  # the config's window size, 1 turn
        fact = asyncio.run(memory.remember_fact("tea at five", {"category": "habit"}, person="Alex"))
    assert fact.metadata == {"category": "habit", "person": "Alex"}
