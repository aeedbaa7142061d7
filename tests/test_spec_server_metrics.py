"""``/metrics`` speculative-decoding counters and gauges, fed a hand-made ``EngineStats`` snapshot."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpage.cache.kv_cache import KVCache
from kvpage.engine.speculative.metrics import SpecDecodingCounters, SpecDecodingStats
from kvpage.server.metrics import ServerMetrics


def snapshot(spec: SpecDecodingStats | None, *, with_field: bool = True) -> Any:
    """An ``EngineStats``-shaped snapshot (duck-typed, hence ``Any``); ``with_field=False``: one from before
    ``spec_decoding`` existed."""
    snap = SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, num_preemptions=0, prompt_tokens=0,
                           generation_tokens=0, kv=KVCache(4, 4).stats())
    if with_field:
        snap.spec_decoding = spec
    return snap


def samples(snap: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape, ``model_name``-labelled metrics left out."""
    text = ServerMetrics(lambda: snap, "m").render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if "model_name" not in s.labels}


def test_spec_decode_metrics_mirror_the_snapshot() -> None:
    c = SpecDecodingCounters(3)
    c.observe(3, 3, 4)
    c.observe(3, 1, 2)
    c.observe(2, 0, 1)
    got = samples(snapshot(c.snapshot()))
    spec = {k: v for k, v in got.items() if k[0].startswith("kvpage:spec_decode")}
    assert spec == {
        ("kvpage:spec_decode_num_drafts_total", ()): 3.0,
        ("kvpage:spec_decode_num_draft_tokens_total", ()): 8.0,
        ("kvpage:spec_decode_num_accepted_tokens_total", ()): 4.0,
        ("kvpage:spec_decode_num_emitted_tokens_total", ()): 7.0,
        ("kvpage:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)): 2.0,
        ("kvpage:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),)): 1.0,
        ("kvpage:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),)): 1.0,
        ("kvpage:spec_decode_acceptance_rate", ()): pytest.approx(4 / 8),
        ("kvpage:spec_decode_mean_accepted_length", ()): pytest.approx(1 + 4 / 3),
    }


def test_every_position_is_exported_from_the_start() -> None:
    got = samples(snapshot(SpecDecodingStats.empty(2)))
    per_pos = sorted(dict(k[1])["position"] for k in got if k[0] == "kvpage:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == ["0", "1"]
    assert got[("kvpage:spec_decode_mean_accepted_length", ())] == 0.0


@pytest.mark.parametrize("with_field", [True, False])
def test_no_spec_decode_metrics_without_speculation(with_field: bool) -> None:
    got = samples(snapshot(None, with_field=with_field))
    assert not [k for k in got if "spec_decode" in k[0]]
    assert got[("kvpage:num_requests_running", ())] == 0.0  # the other metrics are still there
