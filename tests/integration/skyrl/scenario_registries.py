"""SkyRL's named-actor function registries (``PolicyLossRegistry``,
``AdvantageEstimatorRegistry``): a loss registered in the driver after ``ray.init`` reaches a
task and an actor through SkyRL's ``RegistryActor`` (named, ``get_if_exists``), one registered
in an actor reaches the driver, and after ``ray.shutdown``/``ray.init`` the registry finds its
actor stale (``ray.get_actor`` raises ValueError) and syncs a new one, as in SkyRL's tests;
SkyRL's ``TrainingPhaseGauge`` and ``ScalarGauges`` (``ray.util.metrics``) record in an actor.
Run under ``podium run``."""

from __future__ import annotations

import ray
import torch

from skyrl.backends.skyrl_train.utils.ppo_utils import (
    AdvantageEstimatorRegistry,
    PolicyLossRegistry,
)


def doubled_loss(log_probs, *args, **kwargs):
    return 2 * log_probs.sum(), 0.0


ray.init()
PolicyLossRegistry.register("doubled", doubled_loss)
assert "doubled" in ray.get(PolicyLossRegistry._get_or_create_actor().list_available.remote())


@ray.remote
def loss_in_a_task(name: str) -> float:
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry as registry

    loss, _ = registry.get(name)(torch.ones(3))
    return float(loss)


@ray.remote
class Trainer:
    def available(self) -> list:
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry as registry

        return registry.list_available()

    def phases(self) -> list:
        from skyrl.train.utils.metrics import ScalarGauges, TrainingPhaseGauge

        timings: dict = {}
        gauge = TrainingPhaseGauge()  # SkyRL's trainer publishes its phase through ray.util.metrics
        with gauge.timed_phase("eval", timings):
            pass
        ScalarGauges().set("skyrl_test_scalar", 3.0)
        return sorted(timings)

    def register_estimator(self) -> None:
        from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry as registry

        registry.register("zero_advantages", lambda **kwargs: (torch.zeros(1), torch.zeros(1)))


assert ray.get(loss_in_a_task.remote("doubled")) == 6.0
trainer = Trainer.remote()
assert "doubled" in ray.get(trainer.available.remote()) and "regular" in ray.get(trainer.available.remote())
ray.get(trainer.register_estimator.remote())
assert ray.get(trainer.phases.remote()) == ["eval"]
assert "zero_advantages" in AdvantageEstimatorRegistry.list_available()
PolicyLossRegistry.unregister("doubled")  # gone from the registry's actor (a process's own copy stays, as in SkyRL)
assert "doubled" not in ray.get(ray.get_actor("policy_loss_registry").list_available.remote())

# A new session: the registry's actor handle is stale; SkyRL finds that through
# ray.get_actor raising ValueError and syncs its local functions into a new actor.
PolicyLossRegistry.register("doubled_again", doubled_loss)
ray.shutdown()
ray.init()
PolicyLossRegistry.sync_with_actor()
assert ray.get(loss_in_a_task.remote("doubled_again")) == 6.0
print("SCENARIO OK")
