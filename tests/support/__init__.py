"""Helpers the test layers share (imported as ``tests.support.<module>``; no sys.path edits).

- :mod:`.waiting`: ``eventually`` (a polling wait with a deadline) and the repository root.
- :mod:`.processes`: real ``podium scheduler`` / ``podium node`` / worker subprocesses.
- :mod:`.clusters`: a two-node cluster of processes, or the embedded one, for controller tests.
- :mod:`.certs`: a throwaway CA and certificates for mutual TLS.
- :mod:`.live_services`, :mod:`.scheduler_fakes`, :mod:`.agent_fake_worker`: in-process
  services and fakes for integration tests.
- :mod:`.faultkit`, :mod:`.dockerkit`, :mod:`.proctable`, :mod:`.proto_strategies`: fault
  injection, Docker, the process table, hypothesis strategies for protobuf messages.
"""
