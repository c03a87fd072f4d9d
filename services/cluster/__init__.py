"""Ray orchestration: one actor per service plus a controller that sizes the pools.

The only package that imports Ray. Each actor runs the plain service in its own process
(``actors``); the controller (``controller``) reconciles each pool to its desired size, drains
workers before removing them and replaces dead ones; ``driver`` is ``splitserve up`` on Ray.
"""
