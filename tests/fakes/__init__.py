"""Fakes shared by unit and integration tests (``tests/`` is on ``sys.path`` through
``tests/conftest.py``)."""
