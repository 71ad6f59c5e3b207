"""Interfaces (typing.Protocol) the app needs from the outside world."""
