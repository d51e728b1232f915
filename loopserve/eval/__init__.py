"""Evaluating quality against loop depth (`loopserve eval`).

Owns: exact teacher-forced perplexity under early exit, the perplexity-depth curve and its plot,
and GSM8K accuracy with a protocol fingerprint and baseline comparison. Must not: be imported by
the engine or the server.
"""
