"""The cost model: bytes and FLOPs per kernel of a step, measured device rates, floors, prediction and gap attribution.

Its own layer below harness, serving and agent; it reads models, plans and sharding, never the layers above.
"""
