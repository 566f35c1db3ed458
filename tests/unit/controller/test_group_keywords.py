"""``WorkerGroup(**kwargs)`` takes verl's RayWorkerGroup keywords and refuses the rest
(issue #49 item 11): a misspelt keyword is an error naming the closest one, never ignored.
The check runs before the group joins a cluster, so nothing starts here."""

from __future__ import annotations

import inspect

import pytest
from podium.controller.group import keywords
from podium.controller.group.workergroup import WorkerGroup
from podium.errors import InvalidArgumentError, UnimplementedError

# verl 0.9.1, verl/single_controller/ray/base.py, RayWorkerGroup.__init__: its parameters and
# the keys it reads from **kwargs (pop/get).
VERL_PARAMETERS = {"resource_pool", "ray_cls_with_init", "bin_pack", "name_prefix", "detached", "worker_names",
                   "worker_handles", "ray_wait_register_center_timeout"}
VERL_KWARGS = {"master_addr", "master_port", "use_gpu", "master_port_range", "device_name", "profile_steps",
               "worker_nsight_options", "worker_env"}


def test_every_verl_keyword_is_known():
    named = set(inspect.signature(WorkerGroup.__init__).parameters) - {"self", "kwargs"}
    known = named | set(keywords.KWARGS)
    assert not (VERL_PARAMETERS | VERL_KWARGS) - known
    assert named <= set(keywords.NAMED)


def test_a_misspelt_keyword_is_refused_with_the_closest_name():
    with pytest.raises(InvalidArgumentError, match="'standy'.*did you mean 'standby'"):
        WorkerGroup(None, standy=1)
    with pytest.raises(InvalidArgumentError, match="did you mean 'device_name'"):
        WorkerGroup(None, device_nam="cuda")
    with pytest.raises(InvalidArgumentError, match="unknown keyword 'colour'"):
        WorkerGroup(None, colour="blue")


@pytest.mark.parametrize("key", sorted(keywords.REFUSED))
def test_refused_keywords_name_the_alternative(key):
    with pytest.raises(UnimplementedError, match=key) as raised:
        WorkerGroup(None, **{key: {"x": 1}})
    assert keywords.REFUSED[key] in str(raised.value)
    keywords.check_keywords({key: None})  # verl passes None by default


def test_verls_keywords_that_cannot_matter_pass_the_check():
    keywords.check_keywords({"profile_steps": [1, 2], "ray_wait_register_center_timeout": 300,
                             "use_gpu": False, "device_name": "cpu"})
