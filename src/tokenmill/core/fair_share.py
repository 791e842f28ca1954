"""Weighted fair sharing of the engine between tenants, on tokens (no torch).

Each tenant has a virtual time: the tokens its requests were scheduled (prompt chunks, decoded and proposed
tokens) divided by its weight. Among waiting requests of the same class (interactive or batch) and priority, the
tenant with the smallest virtual time is admitted next, and inside a tenant the order stays priority then arrival.
A tenant that becomes active again starts from the smallest virtual time of the active ones, so idling banks no
credit (start-time fair queuing). Seats (the running batch's max_num_seqs) are shared the same way: a tenant with
fewer running requests than its weighted share may take one from a tenant holding more than its own
(`seat_victim`), so one tenant's flood of long requests cannot keep another out of the batch until they end.

Requests without a tenant share one anonymous tenant: with no tenants at all the order is exactly the queue's.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, Optional, Sequence

from tokenmill.request import Request, TenantShare

_ANONYMOUS = ""


def _name(request: Request) -> str:
    return request.tenant.name if request.tenant is not None else _ANONYMOUS


def _weight(request: Request) -> float:
    return request.tenant.weight if request.tenant is not None else 1.0


def _held(running: Sequence[Request]) -> collections.Counter:
    """Running requests per tenant (0 for a tenant with none)."""
    return collections.Counter(_name(r) for r in running)


class FairShare:
    """Virtual times of the tenants with live requests (and of those idle above the floor), and how many live
    (waiting or running) requests each tenant has: the scheduler reports each arrival (`activate`) and each
    request that ends (`retire`), so that no per-request or per-step question scans the queue when one tenant has
    every live request (the case without tenants)."""

    def __init__(self) -> None:
        self._virtual: dict[str, float] = {}
        self._live: collections.Counter = collections.Counter()  # invariant: only tenants with live requests

    @property
    def num_live_tenants(self) -> int:
        """Tenants with waiting or running requests."""
        return len(self._live)

    def virtual_time(self, tenant: str) -> float:
        """The tenant's tokens served, divided by its weight, since it last caught up with the floor."""
        return self._virtual.get(tenant, 0.0)

    def activate(self, request: Request) -> None:
        """`request` arrives (or is forked from a live one). If its tenant had no live request, its virtual time
        catches up with the smallest of the tenants that have (idle time banks nothing), and idle tenants at or
        below that floor are forgotten (they would catch up to it anyway)."""
        name = _name(request)
        if name not in self._live:
            floor = min((self.virtual_time(t) for t in self._live), default=0.0)
            self._virtual = {t: v for t, v in self._virtual.items() if t in self._live or v > floor}
            self._virtual[name] = max(self.virtual_time(name), floor)
        self._live[name] += 1

    def retire(self, request: Request) -> None:
        """`request` ended (finished or aborted): it is no longer live."""
        name = _name(request)
        self._live[name] -= 1
        if self._live[name] <= 0:
            del self._live[name]

    def charge(self, request: Request, tokens: int) -> None:
        """The request's tenant was scheduled `tokens` more tokens."""
        name = _name(request)
        self._virtual[name] = self.virtual_time(name) + tokens / _weight(request)

    def choose(self, candidates: Iterable[Request], running: Sequence[Request]) -> Optional[str]:
        """The tenant the next admission serves, among those with a request of the class and priority of the
        queue's head (`candidates` in queue order, so those requests come first): the smallest virtual time (ties:
        fewer `running` requests, then the earliest request). None when one tenant has every live request (then
        the queue's order decides alone)."""
        if len(self._live) < 2:
            return None
        first_seen: dict[str, int] = {}
        head_class = None
        for index, r in enumerate(candidates):
            if head_class is None:
                head_class = r.priority_key[:2]
            elif r.priority_key[:2] != head_class:
                break  # (the queue is sorted by class and priority)
            first_seen.setdefault(_name(r), index)
            if len(first_seen) == len(self._live):
                break  # every live tenant seen
        held = _held(running)
        return min(first_seen, key=lambda t: (self.virtual_time(t), held[t], first_seen[t]), default=None)

    @staticmethod
    def serves(request: Request, tenant: Optional[str]) -> bool:
        """Whether `request` is of `tenant` (any request, for None)."""
        return tenant is None or _name(request) == tenant

    def leader(self, waiting: Sequence[Request], running: Sequence[Request],
               can_start: Callable[[Request], bool]) -> Optional[tuple[str, float, tuple]]:
        """Of the tenants whose first waiting request of a class can start now (`can_start`: a seat and KV blocks
        for its first chunk), the one the fair share serves next: (the tenant, its virtual time, the class), the
        smallest virtual time first, then the fewest running requests, then the earliest waiting. None when none
        can. Computed once a step for `defers`."""
        first: dict[tuple[str, tuple], int] = {}
        for index, r in enumerate(waiting):
            first.setdefault((_name(r), r.priority_key[:2]), index)
        held = _held(running)
        ready = [(self.virtual_time(t), held[t], index, t, cls) for (t, cls), index in first.items()
                 if can_start(waiting[index])]
        if not ready:
            return None
        vt, _, _, tenant, cls = min(ready)
        return tenant, vt, cls

    def defers(self, request: Request, leader: tuple[str, float, tuple]) -> bool:
        """Whether `request`'s prompt chunk (running, or its first as it is admitted) waits this step for the
        `leader`'s waiting request: it is another tenant's, served no more than this one's (a tenant active again
        starts level), in this request's class or a better one. The leader's request then starts in a step of
        its own prompt and the batch's decodes only: on a CPU a step takes as long as its tokens, so that is its
        time to first token. Never without tenants."""
        tenant, vt, cls = leader
        name = _name(request)
        return name != tenant and vt <= self.virtual_time(name) and cls <= request.priority_key[:2]

    @staticmethod
    def within_share(waiting: Sequence[Request], tenant: TenantShare, prompt_len: int, max_requests: int,
                     max_tokens: int) -> bool:
        """Whether `tenant`'s waiting requests, with one more of `prompt_len` tokens, stay within its weighted share
        of the waiting queue's bounds (the share over itself and the tenants with waiting requests). The engine
        queues such a request even past the bounds, so another tenant's flood cannot lock it out; the queue then
        holds at most the bounds plus each tenant's share of them."""
        weights = {_name(r): _weight(r) for r in waiting}
        weights[tenant.name] = tenant.weight
        share = tenant.weight / sum(weights.values())
        mine = [r for r in waiting if _name(r) == tenant.name]
        lacking = sum(r.num_tokens - r.num_computed_tokens for r in mine)
        return len(mine) + 1 <= max_requests * share and lacking + prompt_len <= max_tokens * share

    def seat_victims(self, running: Sequence[Request], waiting: Sequence[Request], seats: int) -> list[Request]:
        """With the running batch's `seats` all taken: the running requests to preempt so that waiting ones of
        tenants holding fewer seats than their weighted share can run. A victim is of a tenant holding more than
        its share (and still at least its share without it), in the same or a lower class and priority than the
        waiting request it makes room for, and the last of that tenant's in queue order (its lowest priority,
        latest arrival). Shares are over the tenants with live requests: seats x weight / total weight."""
        if not waiting or not running or len(self._live) < 2:
            return []
        weights: dict[str, float] = {}
        for r in (*running, *waiting):
            weights[_name(r)] = _weight(r)
        if len(weights) < 2:
            return []
        held = _held(running)
        total = sum(weights.values())

        def share(tenant: str) -> float:
            return seats * weights[tenant] / total

        victims: list[Request] = []
        unmatched: set[tuple] = set()  # (tenant, class) that found no victim: later requests of theirs find none
        for candidate in waiting:  # in queue order
            tenant = _name(candidate)
            if held[tenant] + 1 > share(tenant) or (tenant, candidate.priority_key[:2]) in unmatched:
                continue
            for victim in reversed(running):
                other = _name(victim)
                if (other != tenant and victim not in victims and held[other] - 1 >= share(other)
                        and victim.priority_key[:2] >= candidate.priority_key[:2]):
                    victims.append(victim)
                    held[other] -= 1
                    held[tenant] += 1  # the seat it is given
                    break
            else:
                unmatched.add((tenant, candidate.priority_key[:2]))
        return victims
