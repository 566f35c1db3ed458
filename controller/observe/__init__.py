"""Looking into a running session from the outside: the timeline of its calls
(:mod:`~podium.controller.observe.timeline`) and the live stacks of its workers
(:mod:`~podium.controller.observe.livestacks`). Both read the session; nothing below them
imports them.
"""
