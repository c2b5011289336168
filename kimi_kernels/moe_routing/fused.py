"""Triton rounds of one-rank capacity routing: two kernels per round instead of ~40 PyTorch ops, or any number of
rounds in one launch.

State between kernels, all on the device (:class:`KernelRounds`): ``held [N, E]`` int8 (token n holds expert
e), ``room [E]`` int32, the round's ``[E, num_bins]`` int32 histogram (the admit kernel zeroes its row after
reading it, ready for the next round), ``proposals [N, E]`` int8 (this round's), and what a host read may
ask after a round: per round ``flags = (anyone proposed, an expert refused)``, and the pairs admitted so far.

Both kernels of a round first read the last round's flags and return at once when it refused nothing: then
every token with a free slot already holds every expert with room, so the round could move nobody. A caller
without host reads can therefore queue every round that could matter (``1 + E``: each refusing round fills an
expert), which is what makes the routing lossless without a host read (``quantile_capacity``; the rounds are
replayed from a CUDA graph there). ``rounds_kernel`` runs such a queue in one launch (``KernelRounds.step_many``):
the two kernels' work per round shared out among one program per SM, with a grid-wide sync after each half, so a
round after the last useful one costs a load instead of two launches (~100 launches per MoE layer at E = 64,
most of them such rounds: ~1 ms of an ``ours_full`` step on an H100, docs/benchmarks.md).

* ``propose_kernel`` (program per TOKEN_TILE / E tokens): walks each token's preference order
  (``argsort`` of the biased scores, stable, best first), proposes to the first ``k - held`` experts it
  does not hold that have room, writes the proposals row and adds them to the round's histogram.
* ``admit_kernel`` (program per expert): from its histogram row, the boundary bin ``b`` (the first whose
  running count from the lowest bin exceeds the excess ``demand - room``) and the quota admitted inside
  it; then one scan over the tokens in blocks of ADMIT_TOKENS: bins above ``b`` are admitted, bin ``b``
  in token order up to the quota. The expert's best ``room`` proposals, as ``quantile_rounds._admit``.
  It also updates ``room``, the round's flags and the admitted count.
* ``result_kernel`` (program per TOKEN_TILE / E tokens): held experts in preference order, then -1;
  dropped and rerouted counts (int64 atomics); program 0 also writes the per-expert load.
"""

import torch
import triton
import triton.language as tl

from kimi_kernels.device import sm_count

# (token, expert) entries per program of the token-parallel kernels: 16 tokens at E = 64, 4 at E = 256
TOKEN_TILE = 1024
ADMIT_TOKENS = 1024
NUM_WARPS = 4


@triton.jit
def _bin_of(score, lo, scale, NUM_BINS: tl.constexpr):
    # quantile_histogram.histogram_bins in fp32: shift, scale, clamp, truncate
    return tl.minimum(tl.maximum((score - lo) * scale, 0.0), NUM_BINS - 1).to(tl.int32)


@triton.jit
def propose_kernel(scores, preference, held, room, proposals, hist, last_flags, N, lo, scale, E: tl.constexpr,
                   EP: tl.constexpr, K: tl.constexpr, NUM_BINS: tl.constexpr, BN: tl.constexpr):
    if tl.load(last_flags + 1) != 0:  # the last round refused a proposal: someone may still move
        _propose_tokens(scores, preference, held, room, proposals, hist, tl.program_id(0), N, lo, scale, E, EP, K,
                        NUM_BINS, BN, "")


@triton.jit
def _propose_tokens(scores, preference, held, room, proposals, hist, tile, N, lo, scale, E: tl.constexpr,
                    EP: tl.constexpr, K: tl.constexpr, NUM_BINS: tl.constexpr, BN: tl.constexpr,
                    SHARED: tl.constexpr):
    """Tokens tile * BN .. + BN - 1 propose (``SHARED``: the cache modifier of loads of what other programs of
    this launch wrote, held and room)."""
    n = tile * BN + tl.arange(0, BN)
    j = tl.arange(0, EP)
    ok = (n < N)[:, None] & (j < E)[None, :]
    row = n.to(tl.int64)[:, None] * E
    expert = tl.load(preference + row + j[None, :], mask=ok, other=0)
    holds = tl.load(held + row + expert, mask=ok, other=0, cache_modifier=SHARED) != 0
    free = K - tl.sum(holds.to(tl.int32), 1)
    available = ok & ~holds & (tl.load(room + expert, mask=ok, other=0, cache_modifier=SHARED) > 0)
    ahead = tl.cumsum(available.to(tl.int32), 1)
    propose = available & (ahead <= free[:, None])
    tl.store(proposals + row + expert, propose.to(tl.int8), mask=ok)
    bins = _bin_of(tl.load(scores + row + expert, mask=ok, other=0.0), lo, scale, NUM_BINS)
    tl.atomic_add(hist + expert * NUM_BINS + bins, 1, mask=propose, sem="relaxed")


@triton.jit
def admit_kernel(scores, held, room, proposals, hist, last_flags, flags, admitted, N, lo, scale, E: tl.constexpr,
                 NUM_BINS: tl.constexpr, BINS_P: tl.constexpr, BT: tl.constexpr):
    if tl.load(last_flags + 1) != 0:  # else the propose kernel skipped this round too: nothing to admit
        _admit_expert(scores, held, room, proposals, hist, flags, admitted, tl.program_id(0), N, lo, scale, E,
                      NUM_BINS, BINS_P, BT, "")


@triton.jit
def _admit_expert(scores, held, room, proposals, hist, flags, admitted, e, N, lo, scale, E: tl.constexpr,
                  NUM_BINS: tl.constexpr, BINS_P: tl.constexpr, BT: tl.constexpr, SHARED: tl.constexpr):
    b = tl.arange(0, BINS_P)
    counts = tl.load(hist + e * NUM_BINS + b, mask=b < NUM_BINS, other=0, cache_modifier=SHARED)
    tl.store(hist + e * NUM_BINS + b, tl.zeros([BINS_P], tl.int32), mask=b < NUM_BINS)  # the next round's
    cum = tl.cumsum(counts, 0)
    demand = tl.sum(counts, 0)
    room_e = tl.load(room + e, cache_modifier=SHARED)
    excess = demand - room_e
    boundary = tl.minimum(tl.sum((cum <= excess).to(tl.int32), 0), NUM_BINS - 1)
    quota = tl.sum(tl.where(b == boundary, cum, 0), 0) - excess
    tl.store(room + e, room_e - tl.minimum(demand, room_e))
    tl.atomic_add(admitted, tl.minimum(demand, room_e), mask=demand > 0, sem="relaxed")
    tl.atomic_max(flags, 1, mask=demand > 0, sem="relaxed")
    tl.atomic_max(flags + 1, 1, mask=excess > 0, sem="relaxed")
    if demand > 0:
        taken = quota * 0  # boundary-bin proposals of earlier token blocks
        for start in range(0, N, BT):
            n = start + tl.arange(0, BT)
            at = n.to(tl.int64) * E + e
            propose = tl.load(proposals + at, mask=n < N, other=0, cache_modifier=SHARED) != 0
            bins = _bin_of(tl.load(scores + at, mask=propose, other=0.0), lo, scale, NUM_BINS)
            at_boundary = propose & (bins == boundary)
            place = taken + tl.cumsum(at_boundary.to(tl.int32), 0)
            admit = (propose & (bins > boundary)) | (at_boundary & (place <= quota))
            tl.store(held + at, tl.full([BT], 1, tl.int8), mask=admit)
            taken += tl.sum(at_boundary.to(tl.int32), 0)


@triton.jit
def _grid_sync(arrivals, target):
    """Every program of the launch waits here until ``target`` arrivals are counted (each sync adds one per
    program; the caller counts them). Release / acquire at GPU scope order each program's earlier stores before
    the others' later loads; those loads bypass L1 (``.cg``), which is not coherent between SMs."""
    tl.debug_barrier()
    tl.atomic_add(arrivals, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(arrivals, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(arrivals, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def rounds_kernel(scores, preference, held, room, proposals, hist, flags, admitted, arrivals, first, count, N, lo,
                  scale, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, NUM_BINS: tl.constexpr,
                  BINS_P: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr):
    """Rounds first .. first + count - 1 in one launch: each is the propose kernel's work over the token tiles and
    the admit kernel's over the experts, shared out among the programs, with a grid-wide sync after each half.
    ``flags`` is the flag table (row r: before step r; step r writes row r + 1). The programs must all be resident
    at once (at most one per SM; one under the interpreter, which runs programs in turn): the launch is
    cooperative, so the driver refuses a grid that cannot be (e.g. under an MPS thread limit) instead of a hang.
    A round after one that refused nothing costs one load: every program reads the same flags after the last sync
    and skips it."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles = tl.cdiv(N, BN)
    syncs = pid * 0
    for step in range(first, first + count):
        if tl.load(flags + step * 2 + 1, cache_modifier=".cg") != 0:
            for tile in range(pid, tiles, programs):
                _propose_tokens(scores, preference, held, room, proposals, hist, tile, N, lo, scale, E, EP, K,
                                NUM_BINS, BN, ".cg")
            syncs += 1
            _grid_sync(arrivals, syncs * programs)
            for e in range(pid, E, programs):
                _admit_expert(scores, held, room, proposals, hist, flags + (step + 1) * 2, admitted, e, N, lo, scale,
                              E, NUM_BINS, BINS_P, BT, ".cg")
            syncs += 1
            _grid_sync(arrivals, syncs * programs)


@triton.jit
def result_kernel(preference, held, room, experts, dropped, rerouted, load, N, capacity, E: tl.constexpr,
                  EP: tl.constexpr, K: tl.constexpr, BN: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    j = tl.arange(0, EP)
    n_ok = n < N
    ok = n_ok[:, None] & (j < E)[None, :]
    row = n.to(tl.int64)[:, None] * E
    expert = tl.load(preference + row + j[None, :], mask=ok, other=0)
    holds = (tl.load(held + row + expert, mask=ok, other=0) != 0) & ok
    slot = tl.cumsum(holds.to(tl.int32), 1) - 1  # among the held, in preference order
    kept = tl.sum(holds.to(tl.int32), 1)
    for s in tl.static_range(K):
        chosen = tl.sum(tl.where(holds & (slot == s), expert, 0), 1)
        tl.store(experts + n.to(tl.int64) * K + s, tl.where(s < kept, chosen, -1).to(tl.int64), mask=n_ok)
    tl.atomic_add(dropped, tl.sum(tl.where(n_ok, K - kept, 0), 0).to(tl.int64), sem="relaxed")
    outside_top_k = tl.sum(tl.sum((holds & (j >= K)[None, :]).to(tl.int32), 1), 0)
    tl.atomic_add(rerouted, outside_top_k.to(tl.int64), sem="relaxed")
    if tl.program_id(0) == 0:
        e = tl.arange(0, EP)
        tl.store(load + e, (capacity - tl.load(room + e, mask=e < E, other=0)).to(tl.int64), mask=e < E)


def tokens_per_program(num_experts):
    return max(1, TOKEN_TILE // triton.next_power_of_2(num_experts))


def _resident_programs(device: torch.device) -> int:
    """Programs of :func:`rounds_kernel` sure to be resident together: one per SM on a GPU (a 4-warp program
    fits any SM); one under the interpreter, which runs the programs of a launch one after another."""
    if device.type != "cuda":
        return 1
    return sm_count(device)


class KernelRounds:
    """The rounds' device state for fp32 ``scores [N, E]`` (contiguous, N >= 1) and a per-expert ``capacity``;
    ``step()`` queues one round (round 1 is the round with nothing held: the plain top-k), at most ``max_steps``; a
    round after one that refused nothing returns at once on the device (nobody could move).
    After a step, without a host read: ``flags[s]`` (int32 ``[2]``: someone proposed, an expert refused) of
    step s and ``admitted`` (int32 ``[1]``: pairs held so far)."""

    def __init__(self, scores, k, capacity, bias, num_bins, score_range, max_steps):
        num_tokens, num_experts = scores.shape
        device = scores.device
        biased = scores if bias is None else scores + bias
        self.scores, self.k, self.capacity, self.num_bins = scores, k, capacity, num_bins
        self.preference = biased.argsort(dim=1, descending=True, stable=True).to(torch.int32)
        self.held = torch.zeros(num_tokens, num_experts, dtype=torch.int8, device=device)
        self.proposals = torch.empty_like(self.held)
        self.room = torch.full((num_experts,), capacity, dtype=torch.int32, device=device)
        self.hist = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=device)
        # Row 0 stands for a round before round 1 that refused something (round 1 always runs); step s writes
        # row s + 1 and its kernels read row s. ``flags`` is the rows of the steps.
        self._flags = torch.zeros(max_steps + 1, 2, dtype=torch.int32, device=device)
        self._flags[0, 1].fill_(1)  # a kernel, not a host copy: this runs inside CUDA graph captures
        self.flags = self._flags[1:]
        self.admitted = torch.zeros(1, dtype=torch.int32, device=device)
        self.steps = 0
        self.lo, hi = score_range
        self.scale = num_bins / (hi - self.lo)  # passed as fp32, as histogram_bins' multiply rounds it
        self.token_grid = (triton.cdiv(num_tokens, tokens_per_program(num_experts)),)
        self.token_tile = dict(EP=triton.next_power_of_2(num_experts), BN=tokens_per_program(num_experts))

    def step(self) -> None:
        if self.steps == self.flags.shape[0]:
            raise RuntimeError(f"KernelRounds: max_steps={self.steps} rounds already ran")
        num_tokens, num_experts = self.held.shape
        shape = dict(E=num_experts, NUM_BINS=self.num_bins, num_warps=NUM_WARPS)
        last_flags = self._flags[self.steps]
        propose_kernel[self.token_grid](self.scores, self.preference, self.held, self.room, self.proposals, self.hist,
                                        last_flags, num_tokens, self.lo, self.scale, K=self.k, **self.token_tile,
                                        **shape)
        admit_kernel[(num_experts,)](self.scores, self.held, self.room, self.proposals, self.hist, last_flags,
                                     self.flags[self.steps], self.admitted, num_tokens, self.lo, self.scale,
                                     BINS_P=triton.next_power_of_2(self.num_bins), BT=ADMIT_TOKENS, **shape)
        self.steps += 1

    def step_many(self, count: int) -> None:
        """``count`` steps in one launch (:func:`rounds_kernel`): the same rounds as ``count`` calls of
        :meth:`step`, without a launch for each round after the last useful one."""
        if count <= 0:
            return
        if self.steps + count > self.flags.shape[0]:
            raise RuntimeError(f"KernelRounds: {count} more rounds would pass max_steps={self.flags.shape[0]} "
                               f"({self.steps} ran)")
        num_tokens, num_experts = self.held.shape
        work = max(self.token_grid[0], num_experts)
        programs = min(work, _resident_programs(self.held.device))
        arrivals = torch.zeros(1, dtype=torch.int32, device=self.held.device)
        rounds_kernel[(programs,)](self.scores, self.preference, self.held, self.room, self.proposals, self.hist,
                                   self._flags, self.admitted, arrivals, self.steps, count, num_tokens, self.lo,
                                   self.scale, E=num_experts, K=self.k, NUM_BINS=self.num_bins,
                                   BINS_P=triton.next_power_of_2(self.num_bins), BT=ADMIT_TOKENS,
                                   num_warps=NUM_WARPS, launch_cooperative_grid=True, **self.token_tile)
        self.steps += count

    def result(self):
        """int64 (experts ``[N, k]``: held experts in preference order, then -1; dropped pairs; rerouted pairs,
        held outside the token's plain top-k; per-expert load ``[E]``)."""
        num_tokens, num_experts = self.held.shape
        experts = torch.empty(num_tokens, self.k, dtype=torch.int64, device=self.held.device)
        counts = torch.zeros(2, dtype=torch.int64, device=self.held.device)  # dropped, rerouted
        load = torch.empty(num_experts, dtype=torch.int64, device=self.held.device)
        result_kernel[self.token_grid](self.preference, self.held, self.room, experts, counts[0:], counts[1:], load,
                                       num_tokens, self.capacity, E=num_experts, K=self.k, num_warps=NUM_WARPS,
                                       **self.token_tile)
        return experts, counts[0], counts[1], load
