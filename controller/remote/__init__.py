"""Ray's shapes on Podium: ``put``, remote functions (tasks), actors and their options,
placement groups. Each is built on the session and on one-worker groups
(:mod:`podium.controller.group`); the ``ray`` stand-in (:mod:`podium.compat.ray`) forwards
to these modules.
"""
