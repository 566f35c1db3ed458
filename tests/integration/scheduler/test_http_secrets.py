"""No secret in any /v1 response: the token never, and user env values whose names say
secret (WANDB_API_KEY, HF_TOKEN, ...) are redacted in /v1/workers."""

from __future__ import annotations

import json

import aiohttp

from podium.scheduler.http import REDACTED, is_secret_name
from podium.v1 import common_pb2
from tests.support.scheduler_fakes import Cluster

SECRET_ENV = {"WANDB_API_KEY": "wandb-5ecret", "HF_TOKEN": "hf-5ecret", "DB_PASSWORD": "pw-5ecret",
              "AWS_SECRET_ACCESS_KEY": "aws-5ecret"}
PLAIN_ENV = {"MONKEY": "not-a-secret", "KEYBOARD_LAYOUT": "us", "NCCL_DEBUG": "INFO"}


def test_secret_names():
    assert all(is_secret_name(k) for k in SECRET_ENV)
    assert not any(is_secret_name(k) for k in PLAIN_ENV)


def test_no_token_and_no_user_secret_in_any_v1_response(token, arun):
    async def scenario():
        async with Cluster(token) as c:
            pg = await c.client.create_placement_group("sec", [{"CPU": 1, "GPU": 1}], "PACK")
            spec = common_pb2.WorkerSpec(name="w0", group="g", placement_group_id=pg.id, num_gpus=1,
                                         num_cpus=1, rank=0, world_size=1, env={**SECRET_ENV, **PLAIN_ENV})
            [worker] = await c.client.wait_workers([w.id for w in await c.client.create_workers([spec])],
                                                   timeout=10)
            # The worker itself gets its whole env (the agent needs it to spawn)...
            assert dict(worker.env)["HF_TOKEN"] == "hf-5ecret"
            # ...but the curl-able views redact it, and nothing carries the token.
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession() as http:
                bodies = {}
                for path in ("/", "/healthz", "/readyz", "/v1/nodes", "/v1/placement", "/v1/workers", "/metrics"):
                    async with http.get(c.running.http_url + path, headers=headers) as resp:
                        assert resp.status == 200, path
                        bodies[path] = await resp.text()
            for path, body in bodies.items():
                assert token not in body, path
                for value in SECRET_ENV.values():
                    assert value not in body, (path, value)
            [doc] = json.loads(bodies["/v1/workers"])["workers"]
            assert {k: doc["env"][k] for k in SECRET_ENV} == dict.fromkeys(SECRET_ENV, REDACTED)
            assert {k: doc["env"][k] for k in PLAIN_ENV} == PLAIN_ENV
            assert "PODIUM_TOKEN" not in doc["env"]
    arun(scenario())
