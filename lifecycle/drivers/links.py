"""Links that contend: concurrent transfers share a link's bandwidth, for a discrete-event simulator.

Sharing discipline: **processor sharing** (fair sharing). While ``n`` transfers are active on a
link each one progresses at ``1/n`` of the link's rate; a transfer that joins or leaves changes
everyone's rate from that instant. We chose it over FIFO because that is how the hardware
interleaves concurrent requests: a GPU's copy engines and the PCIe root complex interleave the
DMA streams of concurrent ``cudaMemcpyAsync`` calls, an NVMe drive serves many submission
queues in parallel (round-robin arbitration between queues), and a NIC interleaves the packets
of concurrent RDMA flows. Under FIFO a small load stuck behind a large store would wait for all
of it; under sharing it finishes in about ``n x`` its solo time, which is what a burst of
equal loads shows on real links (two concurrent equal transfers each take ~2x one alone).

Which transfers share which link (``tier_links``):

- host tier: the GPU's host link is full duplex, so it is two links: host->device carries loads,
  device->host carries stores, and they do not compete (PCIe has one lane set per direction);
- disk tier: one NVMe link, half duplex: reads (loads, prefetch sources) and writes (stores)
  compete for the drive, each at its own rated speed (a write of ``b`` bytes takes ``b /
  write_bw`` of the drive's time, a read ``b / read_bw``);
- remote tier: the NIC, full duplex: loads on receive, stores on transmit.

Each transfer also pays the link's fixed ``latency_ms`` (setup, access latency, round trip)
*after* its bytes drain; latency does not consume bandwidth. A transfer is charged on its tier's
bottleneck link only (a disk load does not also occupy the PCIe link). Per tensor-parallel rank:
each rank has its own links (build one ``tier_links`` per rank).

Exactness and cost: virtual-time bookkeeping. Every active transfer has received the same amount
of service ``V`` since the link was built, so a transfer needing ``s`` ms of exclusive link time
that starts when the counter reads ``V0`` drains when it reaches ``V0 + s``: a heap keyed by that
tag gives the next drain in O(log n), and ``V`` advances at ``1/n`` per ms. Finish times are
recomputed exactly whenever a transfer joins or leaves; everything is deterministic (ties break
by start order).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import attrs

from kvlife.lifecycle.profiles.catalog import Hardware

TransferId = Hashable


class Link:
    """One link (or one direction of a duplex link) shared by processor sharing.

    Simulator protocol:

    1. ``start(tid, nbytes, now)`` whenever a transfer begins (times never go backwards);
    2. ``next_completion()`` -> ``(t, tid)`` of the earliest report, or None: schedule a wake-up
       at ``t`` (re-query after every ``start``: a new transfer delays the others);
    3. at the wake-up, ``advance(now)`` returns every ``(t, tid)`` completed by ``now``, in order
       (possibly none, if a later ``start`` pushed the completion back: re-query and wait again).
    """

    def __init__(self, name: str, bandwidth_gb_s: float, latency_ms: float = 0.0,
                 write_bandwidth_gb_s: float | None = None) -> None:
        if not bandwidth_gb_s > 0 or (write_bandwidth_gb_s is not None and not write_bandwidth_gb_s > 0):
            raise ValueError(f"link {name}: bandwidth must be positive")
        if not latency_ms >= 0:
            raise ValueError(f"link {name}: latency must be non-negative")
        self.name = name
        self.bandwidth_gb_s = bandwidth_gb_s
        self.write_bandwidth_gb_s = write_bandwidth_gb_s if write_bandwidth_gb_s is not None else bandwidth_gb_s
        self.latency_ms = latency_ms
        # bytes per ms
        self._read_rate = bandwidth_gb_s * 1e6
        self._write_rate = self.write_bandwidth_gb_s * 1e6
        self._now = 0.0
        self._virtual = 0.0  # service (exclusive ms) each active transfer has received so far
        self._active: list[tuple[float, int, TransferId]] = []  # heap of (finish tag, seq, tid)
        self._waiting: list[tuple[float, int, TransferId]] = []  # drained, paying latency: (report, seq, tid)
        self._seq = 0
        self.bytes_moved = 0.0

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.bandwidth_gb_s} GB/s, {self.latency_ms} ms, active={len(self._active)})"

    @property
    def active(self) -> int:
        """Transfers still moving bytes."""
        return len(self._active)

    @property
    def in_flight(self) -> int:
        """Transfers not yet reported (moving bytes or paying latency)."""
        return len(self._active) + len(self._waiting)

    def solo_ms(self, nbytes: float, write: bool = False) -> float:
        """How long a transfer takes alone on this link: latency + bytes / bandwidth."""
        return self.latency_ms + nbytes / (self._write_rate if write else self._read_rate)

    def start(self, transfer_id: TransferId, nbytes: float, now: float, write: bool = False) -> None:
        """Begin moving ``nbytes`` at ``now`` (``write``: at the link's write bandwidth)."""
        if nbytes < 0:
            raise ValueError(f"link {self.name}: negative transfer size {nbytes}")
        self._advance_to(now)
        service = nbytes / (self._write_rate if write else self._read_rate)
        heapq.heappush(self._active, (self._virtual + service, self._seq, transfer_id))
        self._seq += 1
        self.bytes_moved += nbytes

    def next_completion(self) -> tuple[float, TransferId] | None:
        """The earliest report still to come, given the transfers started so far."""
        best: tuple[float, int, TransferId] | None = self._waiting[0] if self._waiting else None
        if self._active:
            tag, seq, tid = self._active[0]
            report = self._drain_time(tag) + self.latency_ms
            if best is None or (report, seq) < (best[0], best[1]):
                best = (report, seq, tid)
        return None if best is None else (best[0], best[2])

    def advance(self, now: float) -> list[tuple[float, TransferId]]:
        """Account for time up to ``now``; return the transfers reported by then, in order."""
        self._advance_to(now)
        done = []
        while self._waiting and self._waiting[0][0] <= now:
            report, _, tid = heapq.heappop(self._waiting)
            done.append((report, tid))
        return done

    # --- internals -----------------------------------------------------------------------------

    def _drain_time(self, tag: float) -> float:
        return self._now + max(0.0, tag - self._virtual) * len(self._active)

    def _advance_to(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"link {self.name}: time went backwards ({now} < {self._now})")
        # A drain computed by next_completion may round an ulp past the time it reported.
        slack = 1e-9 * max(1.0, abs(now))
        while self._active:
            tag, seq, tid = self._active[0]
            drain = self._drain_time(tag)
            if drain > now + slack:
                break
            heapq.heappop(self._active)
            drain = min(drain, now)
            self._virtual = max(self._virtual, tag)
            self._now = drain
            heapq.heappush(self._waiting, (drain + self.latency_ms, seq, tid))
        if self._active:
            self._virtual += (now - self._now) / len(self._active)
        self._now = now


@attrs.frozen
class TierLinks:
    """The link a tier's loads use and the one its stores use (the same object when they compete)."""

    load: Link
    store: Link
    store_is_write: bool  # stores run at the link's write bandwidth (NVMe)


def tier_links(hardware: Hardware) -> dict[str, TierLinks]:
    """Fresh links for one rank: host (full duplex PCIe / NVLink-C2C), disk (one NVMe drive, reads
    and writes compete), remote (full-duplex NIC). Bandwidths and latencies from the profile."""
    h2d = Link("host->device", hardware.host_link_gb_s)
    d2h = Link("device->host", hardware.host_link_gb_s)
    nvme = Link("nvme", hardware.nvme.read_gb_s, hardware.nvme.latency_ms,
                write_bandwidth_gb_s=hardware.nvme.write_gb_s)
    rx = Link("network rx", hardware.network.gb_s, hardware.network.latency_ms)
    tx = Link("network tx", hardware.network.gb_s, hardware.network.latency_ms)
    return {
        "host": TierLinks(load=h2d, store=d2h, store_is_write=False),
        "disk": TierLinks(load=nvme, store=nvme, store_is_write=True),
        "remote": TierLinks(load=rx, store=tx, store_is_write=False),
    }
