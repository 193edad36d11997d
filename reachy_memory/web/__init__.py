"""The household's page (``reachy-memory web``): what the robot remembers, and forgetting it.

:mod:`.server` serves it (standard library HTTP server, login token, CSRF checks),
:mod:`.backend` reaches the memory (a store in this process or the daemon),
:mod:`.view` shapes what the page lists; the HTML, CSS and JavaScript are package
data in ``assets/`` (no CDN).  Guide: ``docs/WEB.md``.
"""
