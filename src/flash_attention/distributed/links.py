"""How the ring's K/V and its backward's fp32 dK/dV sums move between ranks (ring.py drives
them step by step; each link starts a step's transfers before the step's calls are launched).

Push (NCCL point-to-point, batch_isend_irecv): every step sends what a rank holds on to the next
rank of a direction and receives the previous rank's. NCCL's kernel needs SMs of its own: the
persistent attention kernels hold every SM, so a transfer waits for them and a step takes the
transfer plus the call (studies/ring_transport.py measured it).

Pull (copy engines; opt-in, transport="pull" or "auto": docs/distributed.md says why): each rank
publishes its K/V, and the sums it passes on, in a symmetric-memory workspace
(torch.distributed._symmetric_memory: every rank maps every rank's buffer), and every step
copies the next step's data straight from the rank that holds it, by cudaMemcpyAsync on a side
stream: copy engines, no SM, so the transfer runs under the call. A device-side barrier of the
group after each step's writes (and at the start and end of a call) orders a pull after the
write it reads and before the next write over it; sums alternate between two slots per direction
(written at step s, read by the next rank during step s + 1, written again at step s + 2, after
the barrier that follows the read). On CPU tensors (gloo) a pull is a matched send/receive at
the same point of the schedule (every rank pulls from the same offset at once), so the CPU tests
check which rank's data each step reads.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "push", "pull")


def _global(group, rank: int) -> int:
    """The global rank of a rank of the group."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _exchange(moves: list[tuple[torch.Tensor, int]], group, rank: int, ranks: int
              ) -> tuple[list[torch.Tensor], list]:
    """Start, for each (t, d) of moves, sending t to rank + d and receiving rank - d's t into a
    new buffer (one batch of P2P operations; every rank posts the same moves in the same order,
    so the sends and receives between any two ranks pair up in order)."""
    if not moves:
        return [], []
    bufs, ops = [], []
    for t, d in moves:
        buf = torch.empty_like(t)
        ops += [dist.P2POp(dist.isend, t, _global(group, (rank + d) % ranks), group),
                dist.P2POp(dist.irecv, buf, _global(group, (rank - d) % ranks), group)]
        bufs.append(buf)
    return bufs, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    """Wait for the requests and empty the list: handles that share one batch's list wait for it
    once (gloo does not take a second wait on a finished send)."""
    while reqs:
        reqs.pop(0).wait()


class Push:
    """NCCL (gloo on CPU) point-to-point: K/V passed on rank to rank, sums with them."""

    def __init__(self, group, kv: tuple[torch.Tensor, torch.Tensor], sums: tuple = (),
                 home: bool = False, share_kv: bool = True, held: dict | None = None) -> None:
        del sums, home, share_kv  # a push makes its buffers as it goes and passes on what it holds
        self.group, (self.k, self.v) = group, kv
        self.shape = torch.Size((2, *self.k.shape))
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.held: dict[int, torch.Tensor] = dict(held or {})
        self._stacked: torch.Tensor | None = None

    def _own(self) -> torch.Tensor:
        """The rank's K/V stacked into one buffer to send (made at its first send)."""
        if self._stacked is None:
            self._stacked = torch.stack((self.k, self.v))
        return self._stacked

    def fetch_kv(self, moves: list[tuple[int, int]]) -> list:
        """Start getting, for each (d, hops), the K/V of rank - d x hops (the previous rank of
        direction d holds them now: each rank passes on what it holds, its own K/V or those
        it was given to start from, link's held); returns handles for arrived()."""
        held = [self.held[d] if d in self.held else self._own() for d, _ in moves]
        bufs, reqs = _exchange([(t, d) for t, (d, _) in zip(held, moves)], self.group,
                               self.rank, self.ranks)
        return [(d, buf, reqs) for (d, _), buf in zip(moves, bufs)]

    def arrived(self, handle) -> torch.Tensor:
        d, buf, reqs = handle
        _wait(reqs)
        self.held[d] = buf
        return buf

    def accumulator(self, d: int, step: int) -> torch.Tensor:
        """A zeroed fp32 buffer shaped like K/V for a step's dK/dV of direction d."""
        return torch.zeros(self.shape, dtype=torch.float32, device=self.k.device)

    def pass_on(self, local: torch.Tensor, d: int, step: int):
        """Hand a step's sum to the next rank of direction d: the handle its next step gets it
        by (start() then get())."""
        bufs, reqs = _exchange([(local, d)], self.group, self.rank, self.ranks)
        return bufs[0], reqs

    def send_home(self, local: torch.Tensor, d: int, n: int, step: int, dtype: torch.dtype):
        """A direction's finished sum (after its last step, n) to the keys' owner, n ranks back,
        in dtype (fp32, or rounded to K/V's: the last rounding done before the transfer); the
        handle the owner gets its keys' sum by."""
        bufs, reqs = _exchange([(local.to(dtype), -d * n)], self.group, self.rank, self.ranks)
        return bufs[0], reqs

    def start(self, handle):
        return handle  # already in flight

    def get(self, handle) -> torch.Tensor:
        buf, reqs = handle
        _wait(reqs)
        return buf

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class WorkspaceError(RuntimeError):
    """A rank could not allocate the pulls' symmetric memory (every rank raises it together)."""


class _Workspace:
    """A group's symmetric-memory buffer on one device (grown, never shrunk; every rank grows it
    at the same call: the ring checks that all ranks pass the same shapes) and its handle. It
    lies outside PyTorch's caching allocator: a growth that fails on a rank first returns the
    cache's free blocks to the driver and tries again, and the ranks agree on the outcome before
    the rendezvous (a rank that failed alone would leave the others waiting there)."""

    _spaces: dict[tuple[str, int], _Workspace] = {}

    def __init__(self, group, nbytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        buf, error = None, ""
        for attempt in range(2):
            try:
                buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
                break
            except RuntimeError as exc:  # the driver's out of memory
                error = str(exc).splitlines()[0]
                if attempt == 0:
                    torch.cuda.empty_cache()
        flag = torch.tensor([0 if buf is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if not flag.item():
            raise WorkspaceError(
                f"transport='pull': a rank could not allocate {nbytes / 2**30:.2f} GiB of "
                f"symmetric memory for the ring's workspace (this rank: "
                f"{error or 'allocated'}); transport='push' needs none")
        self.buf = buf
        self.handle = symm_mem.rendezvous(buf, (group or dist.group.WORLD).group_name)

    @classmethod
    def get(cls, group, nbytes: int, device: torch.device) -> _Workspace:
        key = ((group or dist.group.WORLD).group_name, device.index)
        space = cls._spaces.get(key)
        if space is None or space.buf.numel() < nbytes:
            if space is not None:  # every rank past its last use of the old one, then it goes
                _drain(group, device)
                del cls._spaces[key], space
            space = cls._spaces[key] = cls(group, nbytes, device)
        return space


def _drain(group, device: torch.device) -> None:
    """Returns once every rank's device has run all it was given so far (the pulls from the
    workspace and the barriers on it included: Pull.close joins the side stream), so a rank may
    unmap its buffer: no peer reads it any more."""
    token = torch.zeros(1, device=device)
    dist.all_reduce(token, group=group)
    token.item()


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


class Pull:
    """Copy-engine pulls from a symmetric-memory workspace (CUDA), or the same schedule as
    matched send/receives (gloo, CPU tensors). Regions: the rank's K/V (with share_kv; every
    pull of K/V reads them from their owner, so `held` needs no region), then the fp32 slots
    the backward's sums are made in ((direction, parity) keys: those its plan uses), then with
    home a finished sum rounded to K/V's dtype."""

    def __init__(self, group, kv: tuple[torch.Tensor, torch.Tensor], sums: tuple = (),
                 home: bool = False, share_kv: bool = True, held: dict | None = None) -> None:
        del held  # a pull reads K/V from their owner
        self.group, (self.k, self.v) = group, kv
        self.shape = torch.Size((2, *self.k.shape))
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.cuda = self.k.is_cuda
        kv_bytes = _align(self.shape.numel() * self.k.element_size())
        sum_bytes = _align(self.shape.numel() * 4)
        self.offsets = {"kv": 0} if share_kv else {}
        total = kv_bytes if share_kv else 0
        for key in sums:
            self.offsets[key], total = total, total + sum_bytes
        if home:
            self.offsets["home"], total = total, total + kv_bytes
        if self.cuda:
            self.space = _Workspace.get(group, total, self.k.device)
            self.side = _side_stream(self.k.device)
        else:
            self.local = torch.empty(total, dtype=torch.uint8)
        if share_kv:  # K and V into the region's two halves (no stacked copy first)
            region = self._region("kv", self.rank)
            region[0].copy_(self.k)
            region[1].copy_(self.v)
        self._barrier()

    def _region(self, key, rank: int) -> torch.Tensor:
        """A region of rank's workspace as a tensor (K/V: the input's dtype and shape; a slot:
        fp32)."""
        dtype = self.k.dtype if key in ("kv", "home") else torch.float32
        size = self.shape
        offset = self.offsets[key] // dtype.itemsize
        if not self.cuda:
            assert rank == self.rank
            n = size.numel()
            return self.local.view(dtype)[offset:offset + n].view(size)
        if rank == self.rank:
            n = size.numel()
            return self.space.buf.view(dtype)[offset:offset + n].view(size)
        return self.space.handle.get_buffer(rank, list(size), dtype, offset)

    def _barrier(self) -> None:
        """Every rank's writes so far (on the current stream) before any rank's next reads."""
        if self.cuda:
            self.space.handle.barrier()
        # on CPU every pull is a matched send/receive, ordered by itself

    def _pull(self, key, hops: int) -> tuple:
        """Start copying region key of rank - hops into a new local buffer."""
        src = (self.rank - hops) % self.ranks
        if not self.cuda:
            bufs, reqs = _exchange([(self._region(key, self.rank), hops)], self.group,
                                   self.rank, self.ranks)
            return bufs[0], reqs
        here = torch.cuda.current_stream(self.k.device)
        peer = self._region(key, src)
        buf = torch.empty_like(peer)  # on this stream: the side stream waits for it below
        self.side.wait_stream(here)
        with torch.cuda.stream(self.side):
            buf.copy_(peer)
            done = torch.cuda.Event()
            done.record(self.side)
        return buf, done

    def _ready(self, handle) -> torch.Tensor:
        buf, sync = handle
        if self.cuda:
            torch.cuda.current_stream(self.k.device).wait_event(sync)
        else:
            _wait(sync)
        return buf

    def fetch_kv(self, moves: list[tuple[int, int]]) -> list:
        return [self._pull("kv", d * hops) for d, hops in moves]

    def arrived(self, handle) -> torch.Tensor:
        return self._ready(handle)

    def accumulator(self, d: int, step: int) -> torch.Tensor:
        """The slot a step's sum of direction d is made in (and published from), zeroed: its last
        reader read it before the previous step's barrier."""
        return self._region((d, step % 2), self.rank).zero_()

    def pass_on(self, local: torch.Tensor, d: int, step: int):
        return ("pull", (d, step % 2), d)  # the next rank pulls it at its next step

    def send_home(self, local: torch.Tensor, d: int, n: int, step: int, dtype: torch.dtype):
        if dtype != local.dtype:  # rounded to K/V's dtype in its own region
            self._region("home", self.rank).copy_(local)
            return ("pull", "home", -d * n)
        return ("pull", (d, step % 2), -d * n)  # the owner pulls it after the last step

    def start(self, handle):
        _, key, hops = handle
        return self._pull(key, hops)

    def get(self, handle) -> torch.Tensor:
        if handle[0] == "pull":  # not started: a sum going home, pulled after the last step
            handle = self.start(handle)
        return self._ready(handle)

    def end_step(self) -> None:
        self._barrier()

    def close(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.k.device).wait_stream(self.side)
        self._barrier()  # no rank writes its workspace again before every rank has read it


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index not in _SIDE:
        _SIDE[device.index] = torch.cuda.Stream(device)
    return _SIDE[device.index]


_PULL_OK: dict[str, bool] = {}


def _pull_works(group, device: torch.device) -> bool:
    """Whether every rank of the group can map every other's memory (CUDA peer access between
    their devices, symmetric memory importable), agreed by all ranks; asked once per group."""
    name = (group or dist.group.WORLD).group_name
    if name not in _PULL_OK:
        ranks = dist.get_world_size(group)
        mine = torch.tensor([device.index], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(ranks)]
        dist.all_gather(every, mine, group=group)
        ok = importlib.util.find_spec("torch.distributed._symmetric_memory") is not None
        count = torch.cuda.device_count()
        for other in (int(t.item()) for t in every):
            if other == device.index:
                continue
            if other >= count or not torch.cuda.can_device_access_peer(device.index, other):
                ok = False
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        _PULL_OK[name] = bool(flag.item())
    return _PULL_OK[name]


def link(transport: str, group, kv: tuple[torch.Tensor, torch.Tensor], sums: tuple = (),
         home: bool = False, share_kv: bool = True, held: dict | None = None):
    """The link a ring call moves data by: "push" (NCCL/gloo point-to-point), "pull" (copy
    engines over symmetric memory; matched send/receives on CPU), "auto" (pull on CUDA where
    every rank can map every other's memory and the workspace could be allocated, else push).
    kv: the rank's (K, V), shaped alike (a push stacks them when it first sends them, a pull
    copies them into its workspace; K/V from other ranks travel stacked); sums: the
    (direction, parity) slots the backward's sums are made in; home: whether a finished sum
    goes home rounded to K/V's dtype; share_kv: whether other ranks fetch this rank's K/V;
    held: {direction: K/V} a rank holds before its first fetch, when not its own (the backward
    that starts from the forward's last K/V)."""
    if dist.get_world_size(group) == 1:
        transport = "push"  # nothing moves
    elif transport == "auto":
        if kv[0].is_cuda and _pull_works(group, kv[0].device):
            try:
                return Pull(group, kv, sums, home, share_kv, held)
            except WorkspaceError:  # raised on every rank: all go on by NCCL
                transport = "push"
        else:
            transport = "push"
    return (Pull if transport == "pull" else Push)(group, kv, sums, home, share_kv, held)
