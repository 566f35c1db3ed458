"""Podium's test suite: unit/ (mirroring the packages), integration/ (real servers in the test
process, in folders mirroring the packages), cluster/ (real podium processes), support/ (helpers
they share)."""
