"""Podium's test suite: unit/ (no sockets, mirroring the packages), integration/ (real servers
in the test process), cluster/ (real podium processes), support/ (helpers they share)."""
