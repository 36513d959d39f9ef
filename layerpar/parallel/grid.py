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

from dataclasses import dataclass
from typing import Any, Optional, Union

from .._checks import positive_int
from ..mgrit.transport import (
    DEFAULT_TIMEOUT,
    ErrorChannel,
    Transport,
    check_timeout,
    make_transport,
)
from .sync import SlowLink, SyncStrategy, make_sync

__all__ = ["ProcessGrid"]


@dataclass
class _Shape:
    """A grid's checked arguments (what `ProcessGrid` agrees on before any group)."""

    data: int
    layers: int
    nodes: Optional[int]
    strategy: SyncStrategy
    link: Optional[SlowLink]

    def key(self) -> dict[str, Any]:
        """What must be equal on every process."""
        return {"data": self.data, "layers": self.layers, "nodes": self.nodes,
                **self.strategy.key(),
                "link": None if self.link is None else self.link.key()}


def _check_shape(size: int, data: Any, layers: Any, nodes: Any, sync: Any,
                 link: Any) -> _Shape:
    """`ProcessGrid`'s arguments checked against the `size` processes of its group."""
    data = positive_int("data", data)
    layers = size // data if layers is None else positive_int("layers", layers)
    if data * layers != size:
        raise ValueError(f"a grid of `data`={data} x `layers`={layers} = "
                         f"{data * layers} processes does not match the "
                         f"{size} processes of `comm`")
    if nodes is not None:
        nodes = positive_int("nodes", nodes)
        if data % nodes:
            raise ValueError(f"`nodes`={nodes} must divide `data`={data} (each "
                             "simulated node holds data/nodes replicas)")
    if link is not None and not isinstance(link, SlowLink):
        raise TypeError(f"`link` must be a SlowLink or None, got {type(link).__name__}")
    return _Shape(data, layers, nodes, make_sync(sync), link)


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

    sync: how the replicas stay in step (`layerpar.parallel.sync`): "allreduce"
        (gradients averaged every batch; default), "daso" (hierarchical, asynchronous
        parameter averaging between nodes), "lioncub" (2-bit Lion updates, majority
        vote), or a configured `SyncStrategy`.  Bind it with
        ``grid.sync.attach(model, optimizer)``.
    nodes: how many nodes the replicas are grouped in (None: as the launcher placed
        the processes: LOCAL_WORLD_SIZE under torchrun, shared-memory groups under
        MPI); K simulates K nodes of data/K consecutive replicas each.
    link: a `SlowLink` (or None): inter-node operations of the strategy complete no
        earlier than its latency + bytes / bandwidth.
    `meter` counts the bytes this process sends, by kind ("p2p" in the layer group,
    "data" and "internode" collectives of the data dimension).
    """

    def __init__(self, comm: Any, data: int = 1, layers: Optional[int] = None, *,
                 timeout: Optional[float] = DEFAULT_TIMEOUT,
                 sync: Union[str, SyncStrategy] = "allreduce", nodes: Optional[int] = None,
                 link: Optional[SlowLink] = None) -> None:
        timeout = check_timeout(timeout)
        self.world: Transport = make_transport(comm, timeout=timeout)
        self.world.timeout = timeout
        size = self.world.size
        err: Optional[BaseException] = None
        shape: Optional[_Shape] = None
        try:
            shape = _check_shape(size, data, layers, nodes, sync, link)
        except (TypeError, ValueError) as exc:
            err = exc
        self.world.agree(None if shape is None else shape.key(), err, "ProcessGrid shape")
        if shape is None:  # agree() has raised this rank's error
            raise RuntimeError("ProcessGrid: the shape check failed without an error")
        self.comm = comm
        self.data, self.layers = shape.data, shape.layers
        self.world_rank, self.world_size = self.world.group_rank, size
        self.data_rank, self.layer_rank = divmod(self.world_rank, self.layers)
        self.timeout = timeout
        L, R = self.layers, self.data
        # this process's layer group (the ranks of its replica), then its data group
        # (the ranks holding its layers in every replica), in this order on every rank
        self.layer_comm: Any = self.world.split([[d * L + q for q in range(L)]
                                                 for d in range(R)])
        self.data_comm: Any = self.world.split([[d * L + q for d in range(R)]
                                                for q in range(L)])
        self.meter: dict[str, int] = {}
        self.link = link
        self.node_of = self._node_ids(shape.nodes)
        self.sync: SyncStrategy = shape.strategy
        shape.strategy.setup(self)

    def _node_ids(self, nodes: Optional[int]) -> list[int]:
        """The node (0, 1, ...) of every process of the group (collective)."""
        L, per = self.layers, self.data // nodes if nodes else 0
        if nodes is not None:
            return [(w // L) // per for w in range(self.world_size)]
        keys = self.world.allgather_object(self.world.node_key(), "the node of each process")
        ids: dict[Any, int] = {}
        return [ids.setdefault(k, len(ids)) for k in keys]

    def data_node_count(self) -> int:
        """How many nodes this process's data group spans."""
        return len({self.node_of[d * self.layers + self.layer_rank]
                    for d in range(self.data)})

    def node_split(self) -> tuple[Any, Any, bool]:
        """(this process's node group, the group of the nodes' first replicas or None,
        whether this process is its node's first replica), within its data group: as
        `comm`'s kind of group; a group of one process is None (collective)."""
        L, R = self.layers, self.data
        nodes, leaders = [], []
        for q in range(L):
            by: dict[int, list[int]] = {}
            for d in range(R):
                by.setdefault(self.node_of[d * L + q], []).append(d * L + q)
            nodes += list(by.values())
            leaders.append([m[0] for m in by.values()])
        me = self.world_rank
        leader = any(me == g[0] for g in nodes)
        return self.world.subgroup(nodes), self.world.subgroup(leaders), leader

    @property
    def errors(self) -> Optional[ErrorChannel]:
        """The world's error channel (shared by every transport built on this grid)."""
        return self.world.errors

    def transports(self) -> tuple[Transport, Optional[Transport]]:
        """New transports (duplicates) of the layer group and, with several replicas,
        the data group, sharing the world's error channel (collective)."""
        layer = make_transport(self.layer_comm, errors=self.errors, timeout=self.timeout)
        layer.timeout = self.timeout
        layer.meter = self.meter
        if self.data == 1:
            return layer, None
        data = make_transport(self.data_comm, errors=self.errors, timeout=self.timeout)
        data.timeout = self.timeout
        return layer, data

    def whole(self) -> Transport:
        """A new transport (duplicate) of the whole grid, sharing the world's error
        channel (collective): `LayerParallel`'s per-pass agreements run over it, so that
        a mismatch within a replica or between replicas is seen, and raised alike, by
        every process (checked per group, a replica's mismatch raised on its ranks and
        left the other replicas waiting out the timeout)."""
        whole = make_transport(self.comm, errors=self.errors, timeout=self.timeout)
        whole.timeout = self.timeout
        return whole

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
        """Release the groups this grid made (collective; the world transport's close
        frees the groups split from it)."""
        self.sync.close()
        self.world.close()

    def __repr__(self) -> str:
        return (f"ProcessGrid(data={self.data}, layers={self.layers}; this process: "
                f"replica {self.data_rank}, layer rank {self.layer_rank}, "
                f"backend {self.world.backend})")
