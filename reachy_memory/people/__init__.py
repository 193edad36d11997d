"""People-aware memory: who the robot knows, and memories about them.

``registry`` holds the people (names, aliases, relations, owners) with no I/O;
``ops`` holds the store's people, facts, notes, import and context operations,
which reach the engine only through the narrow interface the store hands them.
"""
