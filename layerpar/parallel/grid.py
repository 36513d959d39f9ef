"""`ProcessGrid`: data parallelism × layer parallelism over one group of processes.

R × L processes form R replicas of a layer-parallel model, each over L ranks.  World
rank w is layer rank ``w % L`` of replica (data rank) ``w // L``: a replica's ranks
are consecutive, so on a node they share memory and its messages (a cycle's many
small ones) stay local, while the gradient average (one bucketed reduction per
batch) crosses replicas.  MGRIT runs inside each *layer group*; each *data group*
(the ranks holding the same layers in every replica) averages those layers'
gradients.  One error channel spans the world, so a failure anywhere stops all.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

from ..mgrit.transport import DEFAULT_TIMEOUT, Transport, check_timeout, make_transport
from ..ode.blocks import _positive_int

__all__ = ["ProcessGrid"]


class ProcessGrid:
    """Split `comm` into `data` replicas of `layers` ranks (collective).

    comm: an mpi4py communicator, a `torch.distributed` process group (e.g.
        ``torch.distributed.group.WORLD``) or None (one process).
    data: number of replicas (data-parallel degree); layers: ranks per replica
        (layer-parallel degree; default: all the rest).  ``data * layers`` must be the
        size of `comm`.

    `LayerParallel(net, grid=grid)` runs MGRIT inside this process's layer group and
    averages gradients over its data group.  Feeding the replicas: `shard(batch)`
    slices a global batch that every process loaded (exactly serial training on that
    batch, for any grid shape), `sampler(dataset)` makes a loader read only this
    replica's part of a dataset (as `DistributedSampler`).  The same arguments must be
    passed on every process (checked: every process raises the same error otherwise,
    before any other message).
    """

    def __init__(self, comm: Any, data: int = 1, layers: Optional[int] = None, *,
                 timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        timeout = check_timeout(timeout)
        self.world: Transport = make_transport(comm, timeout=timeout)
        self.world.timeout = timeout
        size = self.world.size
        err: Optional[BaseException] = None
        try:
            data = _positive_int(data, "data")
            layers = size // data if layers is None else _positive_int(layers, "layers")
            if data * layers != size:
                raise ValueError(f"a grid of `data`={data} x `layers`={layers} = "
                                 f"{data * layers} processes does not match the "
                                 f"{size} processes of `comm`")
        except (TypeError, ValueError) as exc:
            err = exc
        self.world.agree(None if err else {"data": data, "layers": layers}, err,
                         "ProcessGrid shape")
        assert layers is not None
        self.comm = comm
        self.data, self.layers = data, layers
        self.world_rank, self.world_size = self.world.group_rank, size
        self.data_rank, self.layer_rank = divmod(self.world_rank, layers)
        self.timeout = timeout
        self.layer_comm, self.data_comm = self._split(comm)

    def _split(self, comm: Any) -> tuple[Any, Any]:
        """(this process's layer group, its data group) as `comm`'s kind of group."""
        if comm is None:
            return None, None
        if self.world.backend == "mpi":
            layer = comm.Split(color=self.data_rank, key=self.layer_rank)
            data = comm.Split(color=self.layer_rank, key=self.data_rank)
            self._free = [layer, data]
            return layer, data
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(comm)
        L, R = self.layers, self.data
        self._free = []
        if R == 1:  # the layer group is the whole group
            return comm, None
        if L == 1:  # one layer rank per replica: no layer messages
            return None, comm
        # a group over the whole world is created by every process (names by creation
        # order); over a subgroup by its members only (torch names such a group by its
        # ranks and the number of groups the process has: its members must have created
        # the same number of groups before)
        local = len(ranks) != dist.get_world_size()
        backend = "nccl" if self.world.backend == "nccl" else "gloo"
        kw: dict[str, Any] = {"backend": backend, "use_local_synchronization": local}
        if self.timeout is not None:
            kw["timeout"] = datetime.timedelta(seconds=self.timeout)
        mine_layer = mine_data = None
        for d in range(R):  # every process creates every group, in the same order
            members = [ranks[d * L + q] for q in range(L)]
            if not local or d == self.data_rank:
                g = dist.new_group(members, **kw)
                if d == self.data_rank:
                    mine_layer = g
        for q in range(L):
            members = [ranks[d * L + q] for d in range(R)]
            if not local or q == self.layer_rank:
                g = dist.new_group(members, **kw)
                if q == self.layer_rank:
                    mine_data = g
        return mine_layer, mine_data

    @property
    def errors(self) -> Any:
        """The world's error channel (shared by every transport built on this grid)."""
        return getattr(self.world, "_errors", None)

    def transports(self) -> tuple[Transport, Optional[Transport]]:
        """New transports (duplicates) of the layer group and, with several replicas,
        the data group, sharing the world's error channel (collective)."""
        layer = make_transport(self.layer_comm, errors=self.errors, timeout=self.timeout)
        layer.timeout = self.timeout
        if self.data == 1:
            return layer, None
        data = make_transport(self.data_comm, errors=self.errors, timeout=self.timeout)
        data.timeout = self.timeout
        return layer, data

    def shard(self, batch: Any) -> Any:
        """This replica's contiguous share of a global batch that every process holds
        (a tensor, or a tuple/list of them sliced alike): replica d of R takes rows
        [d*n/R, (d+1)*n/R).  Training then equals training on the global batch (the
        gradients are averaged), whatever the grid's shape."""
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.shard(b) for b in batch)
        n = batch.shape[0]
        if n % self.data:
            raise ValueError(f"a batch of {n} samples cannot be split evenly over "
                             f"{self.data} replicas: use a batch size divisible by `data`")
        k = n // self.data
        return batch[self.data_rank * k:(self.data_rank + 1) * k]

    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = True) -> Any:
        """A `DistributedSampler` giving this replica its shard of `dataset` (the layer
        ranks of one replica get the same shard).  With `drop_last` every replica gets
        the same number of samples, so batches have the same shape everywhere; call
        ``set_epoch(e)`` each epoch to reshuffle.  Use a per-replica batch size of
        global batch / `data`."""
        from torch.utils.data.distributed import DistributedSampler

        return DistributedSampler(dataset, num_replicas=self.data, rank=self.data_rank,
                                  shuffle=shuffle, seed=seed, drop_last=drop_last)

    def close(self) -> None:
        """Release the groups this grid made (collective)."""
        for c in getattr(self, "_free", []):
            c.Free()
        self._free = []
        self.world.close()

    def __repr__(self) -> str:
        return (f"ProcessGrid(data={self.data}, layers={self.layers}; this process: "
                f"replica {self.data_rank}, layer rank {self.layer_rank}, "
                f"backend {self.world.backend})")
