"""``RolloutServer``: one rollout replica, a Podium actor serving generation requests.

Disaggregated rollout (verl's async rollout servers): each replica is its own worker
process, not colocated with training. Host it with ``podium.remote(RolloutServer)
.options(max_concurrency=M)``: up to ``M`` of its methods run at once on the actor's
threads, and :class:`~podium.rollout.engine.EngineLoop` batches the concurrent requests
into one vLLM engine. :class:`~podium.rollout.servermanager.RolloutServerManager` is the
client side (load balancing, the update protocol).

The replica is three parts, composed: the engine (:class:`EngineLoop`), the weight receiver
(:class:`~podium.rollout.weights.endpoint.WeightEndpoint`: a link of the broadcast chain,
or a rank of a collective group) and an
:class:`UpdateGate` (which requests may run while weights change). A weight update is:

1. ``begin_update(policy)``: the gate closes (new requests wait), then requests in flight
   are aborted (``"abort"``: their callers get :class:`~podium.errors.AbortedError` naming
   the request and replica) or allowed to finish on the old weights (``"drain"``);
2. ``broadcast_prepare`` / ``broadcast_receive``: the new weights come down the chain and
   load into vLLM (``reload_weights`` + prefix-cache reset); the policy version advances;
3. ``end_update()``: the gate opens; waiting requests run on the new weights.

Every result carries the policy version that generated it: a request runs on one version
only, since an update waits for (or aborts) every request in flight.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from podium.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from podium.rollout.config import RolloutConfig
from podium.rollout.engine import EngineLoop
from podium.rollout.weights.endpoint import WeightEndpoint

__all__ = ["RolloutServer", "UpdateGate", "UPDATE_POLICIES", "MAX_REQUEST_TIMEOUT_S", "check_seconds"]

#: What happens to requests in flight when a weight update starts.
UPDATE_POLICIES = ("abort", "drain")
#: Longest a client may let one request (or a drain) take.
MAX_REQUEST_TIMEOUT_S = 3600.0
#: Actor threads a replica keeps for its control calls (update, broadcast, stats), so that
#: requests waiting at a closed gate can never starve the call that opens it.
CONTROL_THREADS = 3


def check_seconds(value: Any, what: str) -> float:
    """``value`` as float seconds if it is in (0, :data:`MAX_REQUEST_TIMEOUT_S`]; InvalidArgumentError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_REQUEST_TIMEOUT_S:
        raise InvalidArgumentError(f"{what} must be seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}], got {value!r}")
    return float(value)


class UpdateGate:
    """Which requests may start: all of them while open, none while a weight update runs.

    ``active`` counts requests admitted and not yet finished; :meth:`drain` waits for it to
    reach zero. ``version`` is the policy version requests admitted now run on.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.updating = False
        self.active = 0
        self.version = 0
        #: Why the replica stopped serving for good (None: it serves).
        self.retired: str | None = None

    def admit(self, deadline: float, start: Any) -> tuple[int, Any]:
        """Wait (until ``deadline``, a monotonic time) for the gate to be open, then run
        ``start()`` while holding it, so no update begins between the check and the start;
        ``(version, start's result)``."""
        with self.cond:
            while self.updating and self.retired is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError("a weight update held the request past its deadline")
                self.cond.wait(left)
            if self.retired is not None:
                raise AbortedError(f"the replica no longer serves: {self.retired}")
            result = start()
            self.active += 1
            return self.version, result

    def done(self) -> None:
        """One admitted request finished (or failed)."""
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def close(self) -> int:
        """Stop admitting requests (an update starts); how many admitted ones are running."""
        with self.cond:
            if self.updating:
                raise FailedPreconditionError("a weight update is already in progress")
            self.updating = True
            return self.active

    def drain(self, timeout: float) -> None:
        """Wait until no admitted request is left."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.active:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(f"{self.active} requests still running after a drain of {timeout:g} s")
                self.cond.wait(left)

    def retire(self, why: str) -> None:
        """Stop serving for good: waiting and later requests fail with AbortedError."""
        with self.cond:
            self.retired = why
            self.updating = False
            self.cond.notify_all()

    def open(self, version: int | None = None) -> None:
        """Admit requests again (on ``version``, when given)."""
        with self.cond:
            if version is not None:
                self.version = version
            self.updating = False
            self.cond.notify_all()


class RolloutServer:
    """A rollout replica: a vLLM engine serving concurrent requests, taking weight updates
    from the broadcast chain. Host it as a Podium actor with ``max_concurrency`` > 3.

    ``config`` is a :class:`RolloutConfig` (or dict); ``name`` names the replica in errors;
    ``max_requests`` bounds the requests it holds at once (running or waiting at the gate);
    ``seed`` is the engine's sampling seed (default the config's).
    """

    def __init__(self, config: RolloutConfig | dict, name: str = "", max_requests: int = 8,
                 seed: int | None = None) -> None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or not 1 <= max_requests <= 4096:
            raise InvalidArgumentError(f"max_requests must be an int in [1, 4096], got {max_requests!r}")
        self.config = RolloutConfig.from_value(config)
        self.name = name or f"replica pid {os.getpid()}"
        self.max_requests = max_requests
        self.engine = EngineLoop(self.config, name=self.name, seed=seed)
        self.weights_in = WeightEndpoint(self.name, self.engine.load_weights)
        self.gate = UpdateGate()
        self._held = 0  # requests in generate(), waiting or running: bounded by max_requests
        self._held_lock = threading.Lock()  # _held and _counts: updated from the actor's threads
        self._counts = {"served": 0, "aborted": 0, "updates": 0}

    def start(self, model_path: str | None = None, warmup: bool = True) -> dict:
        """Build the engine; ``{"replica", "pid", "model_path", "weights", "build_s", "warmup_s"}``.

        ``warmup`` runs one short request first: vLLM's first step costs seconds (kernels,
        buffers), which would otherwise land on the first real request."""
        info = self.engine.start(model_path)
        start = time.monotonic()
        if warmup:
            self.engine.generate("podium-warmup", [0], 1, timeout=check_seconds(600.0, "timeout"))
        return {"replica": self.name, "pid": os.getpid(), **info, "warmup_s": time.monotonic() - start}

    def shutdown(self) -> None:
        """Stop the engine (requests still waiting fail with FailedPreconditionError)."""
        self.engine.close()

    # ------------------------------------------------------------------ requests

    def generate(self, request_id: str, prompt_ids: list[int], n: int | None = None, width: int | None = None,
                 index: int = 0, timeout: float = 300.0) -> Any:
        """``n`` samples (default the config's) of one prompt, as a DataProto of n rows with
        :mod:`podium.rollout.outputs`' fields plus ``policy_version`` (int64) and the prompt
        left-padded to ``width`` tokens (default its length).

        Raises AbortedError when a weight update aborted it, DeadlineExceededError past
        ``timeout`` seconds, ResourceExhaustedError when ``max_requests`` are already held."""
        import torch

        from podium.dataproto import DataProto
        from podium.rollout.outputs import build_output

        timeout = check_seconds(timeout, "timeout")
        n = self.config.n if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise InvalidArgumentError(f"n must be an int in [1, 256], got {n!r}")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
            raise InvalidArgumentError(f"request_id must be a non-empty string of at most 256 characters, "
                                       f"got {request_id!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 62:
            raise InvalidArgumentError(f"request {request_id}: index must be an int in [0, 2**62), got {index!r}")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise InvalidArgumentError(f"request {request_id}: the prompt is empty")
        width = len(ids) if width is None else int(width)
        if not len(ids) <= width <= self.config.max_model_len:
            raise InvalidArgumentError(f"request {request_id}: width {width} must be in [{len(ids)}, "
                                       f"{self.config.max_model_len}]")
        with self._held_lock:
            if self._held >= self.max_requests:
                raise ResourceExhaustedError(f"replica {self.name} already holds {self.max_requests} requests")
            self._held += 1
        try:
            deadline = time.monotonic() + timeout
            version, future = self.gate.admit(deadline, lambda: self.engine.submit(request_id, ids, n))
            try:
                out = future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                self.engine.abort([request_id], why=f"it ran past its deadline of {timeout:g} s")
                raise DeadlineExceededError(f"request {request_id} on replica {self.name} did not finish in "
                                            f"{timeout:g} s") from None
            except AbortedError:
                with self._held_lock:
                    self._counts["aborted"] += 1
                raise
            finally:
                self.gate.done()
        finally:
            with self._held_lock:
                self._held -= 1
        prompt = torch.zeros(1, width, dtype=torch.int64)
        prompt[0, width - len(ids):] = torch.tensor(ids)
        mask = (torch.arange(width) >= width - len(ids)).to(torch.int64).unsqueeze(0)
        batch = DataProto.from_dict(tensors={"input_ids": prompt, "attention_mask": mask,
                                             "index": torch.tensor([index]),
                                             "policy_version": torch.tensor([version])})
        with self._held_lock:
            self._counts["served"] += 1
        return build_output(batch, [ids], [out], n=n, max_tokens=self.config.max_tokens, pad_id=self.engine.pad_id)

    # ------------------------------------------------------------------ weight updates

    def begin_update(self, policy: str = "drain", timeout: float = 300.0) -> dict:
        """Close the gate, then abort (``"abort"``) or wait out (``"drain"``, at most
        ``timeout`` s) the requests in flight; ``{"replica", "aborted": [ids], "drained", "wait_s"}``."""
        if policy not in UPDATE_POLICIES:
            raise InvalidArgumentError(f"policy must be one of {UPDATE_POLICIES}, got {policy!r}")
        timeout = check_seconds(timeout, "timeout")
        start = time.monotonic()
        running = self.gate.close()  # counted now: aborted requests may leave before the drain starts
        aborted: list[str] = []
        try:
            if policy == "abort":
                aborted = self.engine.abort(why=f"a weight update after version {self.gate.version} started")
            self.gate.drain(timeout)  # aborted ones leave at once; drained ones finish
        except BaseException:
            self.gate.open()  # a failed begin must not leave the replica refusing work
            raise
        return {"replica": self.name, "aborted": aborted, "drained": running - len(aborted),
                "wait_s": time.monotonic() - start}

    def broadcast_prepare(self, timeout: float = 120.0, carrier: str = "chain") -> dict:
        """Ready the next update over ``carrier``; the metadata its routes are built from."""
        return self.weights_in.prepare(carrier, check_seconds(timeout, "timeout"))

    def broadcast_receive(self, downstream: Any, step: int | None = None, carrier: str = "chain") -> dict:
        """Receive one update along ``downstream`` (forwarding it, on a chain), load it into
        vLLM; what happened (:meth:`WeightEndpoint.receive`)."""
        if not self.gate.updating:
            raise FailedPreconditionError(f"replica {self.name}: broadcast_receive outside begin_update/end_update")
        outcome = self.weights_in.receive(downstream, step, carrier)
        with self._held_lock:
            self._counts["updates"] += 1
        return outcome

    def end_update(self, version: int | None = None) -> dict:
        """Open the gate; requests run on ``version`` from now on (unchanged when None, e.g.
        after a failed broadcast that left this replica's weights as they were)."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise InvalidArgumentError(f"version must be an int >= 0, got {version!r}")
        self.weights_in.finalize()
        self.gate.open(version)
        return self.stats()

    def retire(self, why: str) -> dict:
        """Stop serving (an update did not reach this replica, so it holds an old policy):
        requests in flight, waiting or sent later fail with AbortedError naming ``why``."""
        why = str(why)[:500]
        self.weights_in.finalize()
        self.gate.retire(why)
        self.engine.abort(why=f"the replica was retired: {why}")
        return self.stats()

    def stats(self) -> dict:
        """``{"replica", "pid", "version", "updating", "retired", "in_flight", "held", "served", "aborted",
        "updates"}``."""
        return {"replica": self.name, "pid": os.getpid(), "version": self.gate.version, "updating": self.gate.updating,
                "retired": self.gate.retired,
                "in_flight": self.engine.in_flight(), "held": self._held, **self._counts}
