"""The Reachy Mini app of reachy-memory, where Pollen's dashboard looks for it.

The dashboard finds apps through the ``reachy_mini_apps`` entry point; reachy-memory's
is ``reachy_memory = "reachy_memory.main:ReachyMemory"`` (Pollen's layout:
``<package>.main:<Class>``, so the dashboard also finds ``custom_app_url`` below, its
settings page, by reading this file). It starts the app as ``python -u -m
reachy_memory.main`` and stops it with SIGINT. The app itself:
:mod:`reachy_memory.integrations.memory_app`. Needs the robot extra
(``pip install '.[robot]'``); the daemon's command line is ``reachy-memory``
(:mod:`reachy_memory.__main__`), not this.
"""

from __future__ import annotations

import os
import sys

from reachy_memory.integrations.memory_app import URL_ENV, MemoryApp, main


class ReachyMemory(MemoryApp):
    """The memory app (see :mod:`reachy_memory.integrations.memory_app`)."""

    custom_app_url: str | None = "http://0.0.0.0:8042"  # a dashboard that does not import the app reads this line


if URL_ENV in os.environ:  # one that imports it (the daemon's own venv) links to the page where it is
    ReachyMemory.custom_app_url = os.environ[URL_ENV] or None


__all__ = ["ReachyMemory"]

if __name__ == "__main__":
    sys.exit(main(ReachyMemory))
