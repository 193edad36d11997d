"""reachy-memory's ``memory_resume``, a tool for Pollen's Reachy Mini conversation app.

Installed by ``reachy-memory conversation-profile install`` into the app's external tools
directory ($REACHY_MINI_EXTERNAL_TOOLS_DIRECTORY); reachy-memory must be installed in the
app's Python environment. The memory is the reachy-memory daemon's ($REACHY_MEMORY_CONFIG,
$REACHY_MEMORY_ENDPOINT). The app registers the Tool subclass defined in this file.
"""

from reachy_mini_conversation_app.tools.core_tools import Tool

from reachy_memory.integrations.conversation_profile import MemoryResume


class MemoryResumeTool(MemoryResume, Tool):
    """``memory_resume`` as the app's own kind of tool."""
