"""Text the built-in model is trained and evaluated on: the corpus and its token windows.

Owns: what training (`loopserve.train`) and evaluation (`loopserve.eval`) both read, so neither
imports the other. Must not: know the model or an objective.
"""
