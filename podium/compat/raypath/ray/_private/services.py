"""``ray._private.services``: ``get_node_ip_address`` (SkyRL's workers read it for their
master address), the address of the node this process runs on."""

from __future__ import annotations

from podium.compat.standin import get_node_ip_address as _node_ip
from podium.compat.standin import missing

__all__ = ["get_node_ip_address"]


def get_node_ip_address(address: str = "8.8.8.8:53") -> str:
    """The address of this process's node (a worker's node; in the controller, the address
    workers reach it on). ``address`` (which Ray dials to pick an interface) is not used:
    Podium knows the node's address."""
    return _node_ip()


def __getattr__(name: str):
    return missing(f"ray._private.services.{name}", "ray.util.get_node_ip_address()")
