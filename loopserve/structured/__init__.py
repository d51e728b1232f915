"""Structured outputs: constraints compiled into grammars, and the masks they put on tokens."""
