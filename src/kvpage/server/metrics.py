"""Prometheus metrics of one server (``GET /metrics``), named like vLLM's with the ``kvpage:`` prefix.

Each app has its own :class:`~prometheus_client.CollectorRegistry`, so several
servers (tests) in one process never share counters.

Engine state is mirrored, not re-counted: a collector reads the
:class:`~kvpage.engine.engine.EngineStats` snapshot that the engine thread
publishes after each iteration, so ``/metrics`` equals ``engine.stats()``
whenever the engine is idle. The ``spec_decode_*`` metrics exist only when the engine
speculates (``EngineStats.spec_decoding`` is set). Per-request latencies and finish reasons are
observed from outputs on the engine thread (:meth:`ServerMetrics.on_outputs`).

========================================================  ========  ====================================================
name                                                      type      meaning
========================================================  ========  ====================================================
``kvpage:num_requests_running``                           gauge     requests in the running batch
``kvpage:num_requests_waiting``                           gauge     requests queued (new or preempted)
``kvpage:kv_cache_usage_perc``                            gauge     fraction of KV blocks requests hold, 0..1 (vLLM's name
                                                                    and meaning: 0 when idle)
``kvpage:kv_cache_side_usage_perc``                       gauge     fraction of KV blocks lent as side space (int4/int2
                                                                    16-bit tail slots, 8-bit first-block copies; copies
                                                                    of cached prompts stay, reclaimable), 0..1
``kvpage:prefix_cache_hit_rate``                          gauge     prefix hits / queries since start, 0..1
``kvpage:prefix_cache_queries_total``                     counter   prompt tokens looked up in the prefix cache
``kvpage:prefix_cache_hits_total``                        counter   of those, tokens served from it
``kvpage:num_preemptions_total``                          counter   requests preempted (recompute)
``kvpage:prompt_tokens_total``                            counter   prompt tokens computed (cache hits excluded)
``kvpage:generation_tokens_total``                        counter   tokens sampled
``kvpage:tier_hits_total``                                counter   KV blocks served to requests, label ``tier``: ``device``,
                                                                    and with tiers ``host``, ``disk``, ``redis``
``kvpage:tier_bytes_total``                               counter   KV bytes moved between tiers, label ``direction``:
                                                                    ``device_to_host``, ``host_to_device``, ``store_read``,
                                                                    ``store_write``
``kvpage:store_rejected_records_total``                   counter   stored records refused (checksum, layout or key mismatch)
``kvpage:spec_decode_num_drafts_total``                   counter   speculative rounds (request x step) with >= 1 draft token
``kvpage:spec_decode_num_draft_tokens_total``             counter   draft tokens proposed
``kvpage:spec_decode_num_accepted_tokens_total``          counter   draft tokens accepted by the target
``kvpage:spec_decode_num_emitted_tokens_total``           counter   tokens output by speculative rounds (accepted + bonus)
``kvpage:spec_decode_num_accepted_tokens_per_pos_total``  counter   rounds whose draft at label ``position``
                                                                    (``0`` .. ``k-1``) was accepted
``kvpage:spec_decode_acceptance_rate``                    gauge     accepted / draft tokens since start, 0..1
``kvpage:spec_decode_mean_accepted_length``               gauge     1 + accepted / drafts: tokens per speculative round
``kvpage:request_success_total``                          counter   finished requests, label ``finished_reason``:
                                                                    ``stop``, ``length``, ``abort`` (client gone), ``error``
``kvpage:time_to_first_token_seconds``                    hist.     submission to first output token
``kvpage:time_per_output_token_seconds``                  hist.     gap between consecutive output tokens of a request
``kvpage:e2e_request_latency_seconds``                    hist.     submission to finish (finished requests)
========================================================  ========  ====================================================
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpage.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from kvpage.engine.engine import EngineStats
    from kvpage.engine.speculative.metrics import SpecDecodingStats

PREFIX = "kvpage:"

#: Finish reasons reported by ``kvpage:request_success_total`` (each exported from the start, at 0).
FINISH_REASONS = ("stop", "length", "abort", "error")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStatsCollector(Collector):
    """Exports an :class:`EngineStats` snapshot as gauges and counters at scrape time."""

    def __init__(self, get_stats: Callable[[], EngineStats]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        """Yield the engine gauges and counters (see the module table)."""
        s = self._get_stats()
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage: fraction of blocks requests hold, 0..1.", s.kv_usage),
            ("kv_cache_side_usage_perc", "Fraction of KV blocks lent as side space (quantize-on-seal tail slots and "
             "first-block copies; reclaimable when idle), 0..1.",
             getattr(s, "kv_side_usage", 0.0)),  # absent on a snapshot that predates it (a stand-in's)
            ("prefix_cache_hit_rate", "Prefix-cache hit rate since start (hit tokens / queried tokens).",
             s.kv.hit_rate),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.kv.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.kv.prefix_hits),
            ("num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens),
            ("generation_tokens", "Output tokens sampled.", s.generation_tokens),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=float(value))
        hits = CounterMetricFamily(PREFIX + "tier_hits", "KV blocks served to requests, per tier.", labels=["tier"])
        for tier, n in s.kv.tier_hits.items():
            hits.add_metric([tier], float(n))
        yield hits
        moved = CounterMetricFamily(PREFIX + "tier_bytes", "KV bytes moved between tiers, per direction.",
                                    labels=["direction"])
        for direction, n in (s.kv.tiers.tier_bytes if s.kv.tiers is not None else {}).items():
            moved.add_metric([direction], float(n))
        yield moved
        yield CounterMetricFamily(PREFIX + "store_rejected_records",
                                  "Stored KV records refused (checksum, layout or key mismatch); recomputed.",
                                  value=float(s.kv.tiers.store_rejected if s.kv.tiers is not None else 0))
        spec = getattr(s, "spec_decoding", None)  # absent on an EngineStats from before speculation
        if spec is not None:
            yield from _spec_decode_metrics(spec)


def _spec_decode_metrics(spec: SpecDecodingStats) -> Iterator[Metric]:
    """The ``kvpage:spec_decode_*`` counters and gauges of one :class:`SpecDecodingStats` snapshot."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Speculative rounds (request x step) with at least one draft token.",
         spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", spec.num_accepted_tokens),
        ("spec_decode_num_emitted_tokens", "Tokens output by speculative rounds (accepted + bonus/corrected).",
         spec.num_emitted_tokens),
    ):
        yield CounterMetricFamily(PREFIX + name, doc, value=float(value))
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative rounds whose draft at this position (0-based) was accepted.",
                                  labels=["position"])
    for position, n in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(position)], float(n))
    yield per_pos
    yield GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate",
                            "Accepted / draft tokens since start, 0..1 (0 before any draft).",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily(PREFIX + "spec_decode_mean_accepted_length",
                            "Tokens per speculative round, 1 + accepted / drafts (0 before any draft).",
                            value=spec.mean_accepted_length)


class ServerMetrics:
    """The metrics of one server: a private registry, engine-state collector and per-request histograms.

    Args:
        get_stats: returns the latest :class:`EngineStats` (``AsyncEngine.stats``); called on each scrape.
        model_name: value of the ``model_name`` label on the per-request metrics.

    Implements :class:`~kvpage.server.async_engine.EngineObserver`: pass it to the
    :class:`~kvpage.server.async_engine.AsyncEngine`, which calls :meth:`on_outputs`
    on its thread (prometheus-client metrics are thread-safe).
    """

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(get_stats))
        labels = ["model_name"]
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason (abort: the client went away).",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from submission to the first output token.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time between consecutive output tokens of a request.",
            labels, buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from submission to finish.",
            labels, buckets=_E2E_BUCKETS, registry=self.registry,
        )
        self._model = model_name
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self._last_token_time: dict[str, float] = {}

    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None:
        """Observe one step's outputs: time to first token, gaps between tokens, finished requests.

        A request's first token is timed by the engine (``metrics.time_to_first_token_s``);
        later tokens by the gap since the same request's previous output, divided
        among the tokens it added.
        """
        for out in outputs:
            rid = out.request_id
            new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
            last = self._last_token_time.get(rid)
            if new_tokens:
                if last is None:
                    if out.metrics.time_to_first_token_s is not None:
                        self.ttft.labels(self._model).observe(out.metrics.time_to_first_token_s)
                else:
                    gap = (now - last) / new_tokens
                    for _ in range(new_tokens):
                        self.tpot.labels(self._model).observe(gap)
                self._last_token_time[rid] = now
            if out.finished:
                self._last_token_time.pop(rid, None)
                reason = out.outputs[0].finish_reason or "abort"
                self.request_success.labels(self._model, reason).inc()
                if out.metrics.total_time_s is not None and reason not in ("abort", "error"):
                    self.e2e.labels(self._model).observe(out.metrics.total_time_s)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)
