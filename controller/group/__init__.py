"""``WorkerGroup`` (verl's ``RayWorkerGroup``): N worker processes driven as one object.

Building a group reserves its pool's placement groups, asks the scheduler for one worker
process per bundle slot (rank order = node address order), connects to every worker,
constructs the user class in each (concurrently), then binds every ``@register``'ed method
of the class onto the group. Calling a bound method runs verl's pipeline: dispatch ->
pop padding -> execute (all ranks concurrently, or rank 0) -> wait (when blocking) ->
collect -> unpad.

Where Podium deliberately differs from verl:

* Calls to the N workers are concurrent coroutines on the runtime's loop thread, and a
  payload several ranks receive (ONE_TO_ALL, the TP ranks of one dp rank under mesh
  dispatch) is encoded once and the same bytes are sent to each.
* ``blocking=False`` returns PendingRefs / a PendingDataProtoFuture (see
  :mod:`podium.controller.session.futures`); a future's padding is removed through its row range.
* ``Dispatch.RANK_ZERO`` is refused when the group is built, with a message that says to use
  ``Execute.RANK_ZERO`` (verl: a bare ``KeyError``).
* Under ``Execute.RANK_ZERO`` a dispatch that produced per-rank lists sends rank 0 its own
  slice (verl sends it the whole replicated list ``[x] * world_size``).
* ``master_addr``/``master_port`` arguments are refused with a clear error (verl ignores
  them silently); the scheduler reserves MASTER_PORT on rank 0's node.
* Errors: a method that raised gives RemoteError (rank + remote traceback); a worker that
  died gives WorkerDiedError with its rank, node, exit code or signal and stderr tail; every
  call has a deadline (the runtime's call timeout).
* ``spawn(prefix_set)`` maps role methods with the colocated class's own table, so the
  prefix ``actor`` does not also match ``actor_rollout_*`` methods.
* Lifetime is Ray's (:mod:`podium.controller.group.life`): once the group and every view of it
  are garbage, its non-detached workers stop. Two live groups may share a ``name_prefix``
  when their classes differ (:func:`~podium.controller.group.build.distinct_group_key`).

The pieces, each an object or function with one job, composed by the group:

* :mod:`.members`: :class:`GroupMembers`, the workers in rank order and their rendezvous address;
* :mod:`.calls`: :class:`GroupCaller`, the call object that fans a call out to the ranks and
  gathers the results (every bound method and every ``execute_*`` goes through it);
* :mod:`.binding`: the bound methods of the hosted class's registered methods (rank 0 only
  under ``Execute.RANK_ZERO``, read from the registration);
* :mod:`.build`: starting, connecting to and attaching to the workers;
* :mod:`.views`: role views (``spawn``, fused routing);
* :mod:`.life`: Ray's lifetime token;
* :mod:`.handle`: :class:`WorkerHandle`, one worker and its client;
* :mod:`.workergroup`: :class:`WorkerGroup`, verl's surface over them.
"""

from podium.controller.group.binding import func_generator
from podium.controller.group.calls import GroupCaller
from podium.controller.group.handle import WorkerHandle
from podium.controller.group.members import GroupMembers
from podium.controller.group.workergroup import RayWorkerGroup, WorkerGroup

__all__ = ["GroupCaller", "GroupMembers", "RayWorkerGroup", "WorkerGroup", "WorkerHandle", "func_generator"]
