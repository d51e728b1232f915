"""Training the built-in tiny looped model (`loopserve train-tiny`).

Owns: the stdlib corpus and its split, the BPE tokenizer, the two Ouro training stages and the
export of an HF-layout checkpoint. Must not: be imported by the engine or the server.
"""
