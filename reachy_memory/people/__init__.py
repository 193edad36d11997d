"""People-aware memory: who the robot knows, and memories about them.

``registry`` holds the people (names, aliases, relations, owners) with no I/O.
The components the store builds, each given the narrow ``engine.ports.Engine``:
``persons`` (add, find, resolve, update, merge, delete), ``facts`` (remember, recall,
correct, confirm, supersede, history), ``notes`` (named notes, archives),
``importer`` (import and the checks every import path shares) and ``context``
(one-call prompt context).  ``subjects`` is what search reads of people;
``checks`` the argument checks they share.
"""
