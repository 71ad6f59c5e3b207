"""Shared pytest set-up.

Having this file here puts ``tests/`` on ``sys.path`` (pytest's default "prepend" import
mode inserts a root conftest's directory), so test modules can ``import fakes``.
"""
