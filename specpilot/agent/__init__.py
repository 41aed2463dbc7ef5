"""The optimization loop: rewrite space, proposers, isolated evaluation, the gate, memory, rounds."""
