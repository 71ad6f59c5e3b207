"""``rd2h probe``: two-endpoint transport checks a deployment runs before serving (a
harness around the library; nothing in the library imports it)."""
