"""Checks against the installed sglang packages (a package, so its conftest does not shadow tests/bridge/conftest.py under one pytest run)."""
