"""Demo Reachy Mini app using reachy-memory (see main.py)."""
