"""``EngineLoop``: one in-process vLLM engine, stepped by one thread, serving many callers.

vLLM's offline ``LLM.generate`` runs one batch to completion and is not safe to call from
several threads. A rollout server takes requests one at a time from many client threads
(a Podium actor's ``max_concurrency`` pool), so this object owns the engine's
``LLMEngine`` and a single engine thread: a caller hands its request to that thread and
waits on its own :class:`concurrent.futures.Future`; the thread steps the engine
while any request is unfinished, so requests that arrive while others run join the running
batch (vLLM's continuous batching). Aborting a request removes it from the engine and
fails its future with :class:`~podium.errors.AbortedError`.

Every engine call (build, add, abort, load, step) runs on that thread: vLLM's engine is not
thread-safe, its CPU attention checks the OpenMP thread count it was built with, and a
weight load then never interleaves with a step. Whether requests may still be running when
weights change is the caller's policy (see :mod:`podium.rollout.server`).
"""

from __future__ import annotations

import concurrent.futures
import logging
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
from podium.rollout.vllm import cleanup_vllm_process_state, build_llm, expected_weight_shapes, load_into_engine
from podium.rollout.weights import check_weights

__all__ = ["EngineLoop", "MAX_REQUESTS"]

log = logging.getLogger("podium.rollout")

#: Most requests one engine holds at once (each is a group of n samples).
MAX_REQUESTS = 4096
#: The stepping thread re-checks for shutdown at least this often while idle.
_IDLE_WAKE_S = 1.0


class EngineLoop:
    """A vLLM engine in this process, stepped by its own thread; thread-safe :meth:`generate`.

    ``name`` says which engine an error comes from (a replica's name). Build it with
    :meth:`start`; :meth:`close` stops the thread and the engine.
    """

    def __init__(self, config: RolloutConfig | dict, name: str = "engine", seed: int | None = None) -> None:
        self.config = RolloutConfig.from_value(config)
        self.name = name
        self.seed = self.config.seed if seed is None else int(seed)
        self.llm: Any = None
        self.expected: dict[str, tuple[int, ...]] = {}
        self.pad_id = 0
        self.vocab_size = 1 << 62
        # Calls for the engine thread, and the requests it steps: touched by it alone,
        # except _calls, which callers append to under _wake.
        self._wake = threading.Condition(threading.Lock())
        self._calls: list[tuple[Any, concurrent.futures.Future]] = []
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ life

    def start(self, model_path: str | None = None, timeout: float = 600.0) -> dict:
        """Start the engine thread, build the engine on it (``model_path`` or the config's),
        and return engine facts. Every engine call runs on that one thread: vLLM's CPU
        attention checks that its kernels run with the OpenMP thread count it was built with."""
        if self._thread is not None:
            raise FailedPreconditionError(f"{self.name}: the engine is already built")
        path = str(model_path if model_path is not None else self.config.model_path)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"podium-engine-{self.name}", daemon=True)
        self._thread.start()
        start = time.monotonic()
        try:
            self.llm = self._on_engine(lambda: build_llm(self.config, path, seed=self.seed), timeout)
        except BaseException:
            self.close()
            raise
        self.expected = expected_weight_shapes(path)
        embed = self.expected.get("model.embed_tokens.weight") or self.expected.get("lm_head.weight")
        #: Token ids a prompt may hold (vLLM's own check would raise a plain ValueError).
        self.vocab_size = embed[0] if embed else 1 << 62
        tok = self.llm.get_tokenizer()
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        return {"model_path": path, "weights": len(self.expected), "build_s": time.monotonic() - start}

    def close(self, timeout: float = 30.0) -> None:
        """Fail every waiting request, shut the engine down on its thread and stop the thread
        (waiting at most ``timeout``)."""
        if self._thread is None:
            return
        try:
            if self.llm is not None:
                self._on_engine(self._shutdown_engine, timeout)
        finally:
            with self._wake:
                self._closed = True
                self._wake.notify_all()
            self._thread.join(timeout)
            self._thread = None

    def _shutdown_engine(self) -> None:
        self._fail_all(FailedPreconditionError(f"{self.name}: the engine was shut down"))
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm, core
        cleanup_vllm_process_state()

    def _on_engine(self, fn: Any, timeout: float = 120.0) -> Any:
        """Run ``fn()`` on the engine thread (between two steps) and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._closed or self._thread is None:
                raise FailedPreconditionError(f"{self.name}: the engine is not running")
            self._calls.append((fn, future))
            self._wake.notify_all()
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceededError(f"{self.name}: the engine thread did not answer in {timeout:g} s") from None

    # ------------------------------------------------------------------ requests

    def in_flight(self) -> int:
        """Requests added and not yet finished or aborted."""
        return len(self._pending)

    def submit(self, request_id: str, prompt_ids: list[int], n: int) -> concurrent.futures.Future:
        """Add one request of ``n`` samples of ``prompt_ids``; a future of vLLM's
        ``RequestOutput`` (or of the error that ended it: AbortedError when aborted)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self.llm is None:
            raise FailedPreconditionError(f"{self.name}: the engine is not running")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise InvalidArgumentError(f"n must be an int in [1, 256], got {n!r}")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(f"request {request_id}: token ids {bad[:5]} are outside the vocabulary "
                                       f"[0, {self.vocab_size})")
        cfg = self.config
        if len(prompt_ids) + cfg.max_tokens > cfg.max_model_len:
            raise InvalidArgumentError(f"request {request_id}: a prompt of {len(prompt_ids)} tokens plus max_tokens "
                                       f"{cfg.max_tokens} does not fit max_model_len {cfg.max_model_len}")
        params = SamplingParams(n=n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, ignore_eos=cfg.ignore_eos, logprobs=0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def add() -> None:
            if request_id in self._pending:
                raise InvalidArgumentError(f"{self.name}: request {request_id!r} is already running")
            if len(self._pending) >= MAX_REQUESTS:
                raise ResourceExhaustedError(f"{self.name}: {MAX_REQUESTS} requests already running")
            self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)
            self._pending[request_id] = future

        self._on_engine(add)
        return future

    def generate(self, request_id: str, prompt_ids: list[int], n: int, timeout: float) -> Any:
        """:meth:`submit` and wait at most ``timeout`` seconds for the ``RequestOutput``.

        Raises AbortedError when the request was aborted, DeadlineExceededError (after
        aborting it) when it ran out of time."""
        future = self.submit(request_id, prompt_ids, n)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.abort([request_id], why=f"it ran past its deadline of {timeout:g} s")
            raise DeadlineExceededError(f"{self.name}: request {request_id!r} did not finish in {timeout:g} s") \
                from None

    def abort(self, request_ids: list[str] | None = None, why: str = "aborted") -> list[str]:
        """Remove requests from the engine (all when ``request_ids`` is None) and fail their
        futures with AbortedError naming the request, this engine and ``why``; the ids aborted."""
        def remove() -> list[str]:
            ids = list(self._pending) if request_ids is None else [r for r in request_ids if r in self._pending]
            if ids and self.llm is not None:
                self.llm.llm_engine.abort_request(ids)
            for rid in ids:
                future = self._pending.pop(rid)
                future.set_exception(AbortedError(
                    f"request {rid} on replica {self.name} was aborted: {why}",
                    details={"request_id": rid, "replica": self.name}))
            return ids

        return self._on_engine(remove)

    # ------------------------------------------------------------------ weights

    def load_weights(self, pairs: list[tuple[str, Any]], timeout: float = 300.0) -> dict:
        """Load a whole model of ``(name, tensor)`` pairs between two steps; names and shapes
        must be the model's (InvalidArgumentError names the first that are not)."""
        if self.llm is None:
            raise FailedPreconditionError(f"{self.name}: the engine is not running")
        items = check_weights(pairs, self.expected)
        start = time.monotonic()
        self._on_engine(lambda: load_into_engine(self.llm, items), timeout)
        return {"tensors": len(items), "load_s": time.monotonic() - start}

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._calls and not self._closed:
                    self._wake.wait(_IDLE_WAKE_S)
                if self._closed and not self._calls:
                    return
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller hears it
                    future.set_exception(exc)
            if not self._pending or self.llm is None:
                continue
            try:
                outputs = self.llm.llm_engine.step()
            except Exception as exc:  # noqa: BLE001 - the engine broke: every waiter hears why
                log.exception("%s: engine step failed", self.name)
                self._fail_all(FailedPreconditionError(f"{self.name}: engine step failed: {exc!r}"))
                continue
            for out in outputs:
                if getattr(out, "finished", False):
                    done = self._pending.pop(out.request_id, None)
                    if done is not None:  # None: aborted meanwhile, its waiter already told
                        done.set_result(out)

    def _fail_all(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
