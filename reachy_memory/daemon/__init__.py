"""The daemon: the engine served over ZeroMQ to the control loop and apps.

* ``server``: the ``Daemon`` (I/O, embed and engine threads, expiry, watchdog);
* ``operations``: the one table of operations (arguments, thread, reply);
* ``protocol``: the wire format (msgpack maps) shared with the clients;
* ``endpoint``, ``http_auth``: where it listens and who may talk to it;
* ``clock``, ``systemd``: wall-clock steps, and sd_notify/watchdog.
"""
