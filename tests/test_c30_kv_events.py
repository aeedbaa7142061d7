"""Case C30: KV cache events on the wire, in vLLM's format, rebuild the engine's prefix index (issue 32 item 1).

A subscriber written here from vLLM's documented layout (``vllm/distributed/kv_events.py``: three frames, topic,
8-byte big-endian sequence, msgpack ``[ts, events, data_parallel_rank]``; events tagged maps or positional arrays)
decodes every batch and rebuilds the set of cached block hashes; after hundreds of requests with evictions and a
``reset_prefix_cache`` it equals the engine's index, and a subscriber that missed batches recovers them through
the replay socket. The decoder types below are the test's own: they do not import kvpage's wire module.
"""

import argparse
import random
import socket
import time
from typing import Any, Union

import msgspec
import pytest
import zmq

from _tiny import tiny_loaded
from kvpage.cache.kv_events import KVEventsConfig
from kvpage.cache.kv_events.publisher import ZmqEventPublisher
from kvpage.cache.prefix_cache import BlockRemoved, BlockStored
from kvpage.engine.config import EngineConfig
from kvpage.engine.llm import LLM
from kvpage.engine.sampling import SamplingParams


# -- an independent decoder, from vLLM's documented layout ------------------------------------------------------

def _decoder(array_like: bool) -> msgspec.msgpack.Decoder:
    class Ev(msgspec.Struct, tag=True, array_like=array_like):
        pass

    class BlockStoredT(Ev, tag="BlockStored"):
        block_hashes: list[Union[bytes, int]]
        parent_block_hash: Union[bytes, int, None]
        token_ids: list[int]
        block_size: int
        lora_id: Union[int, None]
        medium: Union[str, None]
        lora_name: Union[str, None] = None
        extra_keys: Any = None
        group_idx: Union[int, None] = None
        kv_cache_spec_kind: Union[str, None] = None
        kv_cache_spec_sliding_window: Union[int, None] = None

    class BlockRemovedT(Ev, tag="BlockRemoved"):
        block_hashes: list[Union[bytes, int]]
        medium: Union[str, None]
        group_idx: Union[int, None] = None

    class AllBlocksClearedT(Ev, tag="AllBlocksCleared"):
        pass

    class BatchT(msgspec.Struct, array_like=True):  # the envelope stays positional in both encodings
        ts: float
        events: list[Union[BlockStoredT, BlockRemovedT, AllBlocksClearedT]]
        data_parallel_rank: Union[int, None] = None

    return msgspec.msgpack.Decoder(BatchT)


DECODERS = {"tagged": _decoder(False), "array": _decoder(True)}


class Subscriber:
    """Rebuilds the device tier's set of cached hashes from a SUB socket, replaying any gap through ROUTER."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None, encoding: str, topic: bytes = b"",
                 skip_every: int = 0) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint, self.ctx = replay, ctx
        self.decoder = DECODERS[encoding]
        self.hashes: set[Any] = set()
        self.seqs: list[int] = []  # applied, in order
        self.last = -1
        self.skip_every = skip_every
        self.received = self.replayed = 0
        self.n_events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.topic = topic

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last + 1, f"batch {seq} applied after {self.last}"
        batch = self.decoder.decode(payload)
        assert isinstance(batch.ts, float) and batch.data_parallel_rank == 0
        for ev in batch.events:
            kind = type(ev).__name__.removesuffix("T")
            self.n_events[kind] += 1
            if kind != "AllBlocksCleared" and ev.medium != "GPU":
                continue
            if kind == "BlockStored":
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.hashes
                self.hashes.update(ev.block_hashes)
            elif kind == "BlockRemoved":
                assert set(ev.block_hashes) <= self.hashes, "removal of a block never stored"
                self.hashes.difference_update(ev.block_hashes)
            else:
                self.hashes.clear()
        self.seqs.append(seq)
        self.last = seq

    def _replay(self, upto: int) -> None:
        """Fetch and apply batches ``last + 1 ..`` from the replay socket (up to ``upto`` exclusive)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq_b, payload = dealer.recv_multipart()
                assert empty == b"" and len(seq_b) == 8
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1:
                    assert payload == b""
                    break
                if self.last < seq < upto:
                    self._apply(seq, payload)
                    self.replayed += 1
        finally:
            dealer.close(linger=0)

    def drain(self, timeout_ms: int = 300) -> None:
        """Read every waiting message (replaying gaps), until none came for ``timeout_ms``."""
        while self.sub.poll(timeout_ms):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic.startswith(self.topic) and len(seq_b) == 8
            seq = int.from_bytes(seq_b, "big")
            self.received += 1
            if self.skip_every and self.received % self.skip_every == 0:
                continue  # drop it: a later batch's gap brings it back through replay
            if seq <= self.last:
                continue
            if seq > self.last + 1:
                self._replay(seq)
            self._apply(seq, payload)

    def catch_up(self) -> None:
        """Replay whatever is left after the last received batch (a dropped final batch has no later gap)."""
        self._replay(1 << 62)

    def close(self) -> None:
        self.sub.close(linger=0)


def _wire_hash(h: bytes, form: str) -> Any:
    """A block hash as vLLM puts it on the wire: the low 64 bits as an unsigned int (its default), or the digest."""
    return int.from_bytes(h[-8:], "big") if form == "int" else h


def _index(llm: LLM) -> set[Any]:
    """The engine's prefix index, its hashes in the wire form its events use."""
    pool = llm.engine.kv.pool
    form = llm.engine.kv_events.sink.config.block_hash_format
    return {_wire_hash(h, form) for h in (pool.block_hash(b) for b in range(pool.num_blocks)) if h is not None}


def _settle(llm: LLM, sub: Subscriber) -> None:
    assert llm.engine.kv_events.sink.flush(10.0)
    sub.drain()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _llm(tmp_path, encoding: str, **events: Any) -> LLM:
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
           "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv", "encoding": encoding, **events}
    return LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=4, num_blocks=24, max_num_seqs=4,
               attention_backend="reference", progress=False, kv_events_config=cfg)


def _workload(rng: random.Random, n: int) -> list[dict]:
    """``n`` token prompts over a few shared prefixes (hits) and random tails (new blocks, so evictions)."""
    stems = [[rng.randrange(256) for _ in range(8)] for _ in range(6)]
    return [{"prompt_token_ids": rng.choice(stems)[: rng.choice([4, 8])] + [rng.randrange(256)
                                                                          for _ in range(rng.randrange(3, 14))]}
            for _ in range(n)]


# -- C30: the rebuilt set equals the index -------------------------------------------------------------------

@pytest.mark.parametrize(("encoding", "form"), [("tagged", "int"), ("array", "bytes")])
def test_c30_subscriber_rebuilds_prefix_index_through_evictions_and_reset(tmp_path, ctx, encoding, form):
    llm = _llm(tmp_path, encoding, block_hash_format=form)
    sub = Subscriber(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", encoding, topic=b"kv")
    time.sleep(0.2)  # the SUB socket's subscription reaches the publisher (a missed start is replayed anyway)
    rng = random.Random(30)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    try:
        for round_ in range(5):
            llm.generate(_workload(rng, 45), params)
            _settle(llm, sub)
            assert sub.hashes == _index(llm), f"round {round_}"
            if round_ == 2:
                before = len(sub.hashes)
                llm.reset_prefix_cache()
                _settle(llm, sub)
                assert before > 0 and sub.hashes == _index(llm) == set()
                assert sub.n_events["AllBlocksCleared"] == 1
        assert llm.engine.kv.pool.num_evictions > 100  # the workload evicted (24 blocks, ~225 requests)
        assert sub.n_events["BlockRemoved"] > 10 and sub.n_events["BlockStored"] > 50
        assert sub.seqs == list(range(len(sub.seqs)))  # monotone, contiguous across the reset
        assert sub.seqs[-1] + 1 == llm.engine.kv_events.sink.num_published
        assert len(sub.hashes) > 0
    finally:
        sub.close()
        llm.close()


def test_c30_subscriber_that_drops_batches_recovers_them_through_replay(tmp_path, ctx):
    llm = _llm(tmp_path, "tagged")
    rng = random.Random(31)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    try:
        llm.generate(_workload(rng, 40), params)  # before anyone subscribes: only replay has these
        assert llm.engine.kv_events.sink.flush(10.0)
        late = Subscriber(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "tagged", topic=b"kv",
                          skip_every=3)
        time.sleep(0.2)
        for _ in range(4):
            llm.generate(_workload(rng, 40), params)
            _settle(llm, late)
        late.catch_up()
        assert late.replayed > 10 and late.received > 10
        assert late.seqs == list(range(llm.engine.kv_events.sink.num_published))
        assert late.hashes == _index(llm) and late.hashes
        late.close()
    finally:
        llm.close()


def test_c30_replay_buffer_is_bounded_by_buffer_steps(tmp_path, ctx):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/p",
                         replay_endpoint=f"ipc://{tmp_path}/r", buffer_steps=3)
    pub = ZmqEventPublisher(cfg, block_size=2)
    try:
        for i in range(6):
            pub.publish([("GPU", BlockStored(bytes([i]) * 32, None, (i, i), i))])
        assert pub.flush(5.0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/r")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            _, seq_b, payload = dealer.recv_multipart()
            got.append((int.from_bytes(seq_b, "big", signed=True), payload))
            if got[-1][0] == -1:
                break
        dealer.close(linger=0)
        assert [s for s, _ in got] == [3, 4, 5, -1] and got[-1][1] == b""
        assert DECODERS["tagged"].decode(got[0][1]).events[0].block_hashes == [_wire_hash(bytes([3]) * 32, "int")]
    finally:
        pub.close()


# -- the wire format -----------------------------------------------------------------------------------------

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, bytes(range(32))
I1, I2, I3 = 0x0101010101010101, 0x0202020202020202, 0x18191A1B1C1D1E1F  # low 64 bits, big-endian (vLLM's default)
RECORDS = [("GPU", BlockStored(H1, None, (1, 2), 0)), ("GPU", BlockStored(H2, H1, (3, 4), 1)),
           ("CPU", BlockStored(H3, H2, (5, 6), 7)), ("GPU", BlockRemoved(H2, 1)), ("GPU", BlockRemoved(H1, 0))]


def _publish_and_receive(tmp_path, ctx, encoding: str, batches: int = 2, form: str = "int") -> list[list[bytes]]:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/w", topic="kv-events",
                         encoding=encoding, block_hash_format=form)
    pub = ZmqEventPublisher(cfg, block_size=2)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/w")
    time.sleep(0.3)
    try:
        for _ in range(batches):
            pub.publish(RECORDS, ts=1234.5)
        assert pub.flush(5.0)
        frames = []
        while len(frames) < batches and sub.poll(5000):
            frames.append(sub.recv_multipart())
        return frames
    finally:
        sub.close(linger=0)
        pub.close()


def test_c30_wire_tagged_frames_and_map_events(tmp_path, ctx):
    frames = _publish_and_receive(tmp_path, ctx, "tagged")
    assert [len(f) for f in frames] == [3, 3]
    assert [f[0] for f in frames] == [b"kv-events", b"kv-events"]
    assert [f[1] for f in frames] == [b"\x00" * 8, b"\x00" * 7 + b"\x01"]  # 8-byte big-endian 0, 1
    raw = msgspec.msgpack.decode(frames[0][2])
    assert raw == [1234.5, [
        {"type": "BlockStored", "block_hashes": [I1, I2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": [I3], "parent_block_hash": I2, "token_ids": [5, 6],
         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [I2, I1], "medium": "GPU", "group_idx": 0},
    ], 0]
    batch = DECODERS["tagged"].decode(frames[1][2])
    assert [type(e).__name__ for e in batch.events] == ["BlockStoredT", "BlockStoredT", "BlockRemovedT"]


def test_c30_wire_array_positional_events(tmp_path, ctx):
    frames = _publish_and_receive(tmp_path, ctx, "array", batches=1, form="bytes")
    assert frames[0][1] == (0).to_bytes(8, "big")
    raw = msgspec.msgpack.decode(frames[0][2])
    assert raw == [1234.5, [
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4], 2, None, "GPU", None, None, 0, "full_attention", None],
        ["BlockStored", [H3], H2, [5, 6], 2, None, "CPU", None, None, 0, "full_attention", None],
        ["BlockRemoved", [H2, H1], "GPU", 0],
    ], 0]
    batch = DECODERS["array"].decode(frames[0][2])
    assert batch.events[0].block_hashes == [H1, H2] and batch.events[2].medium == "GPU"


def test_c30_reset_with_blocks_in_use_sends_removals_but_no_clear(tmp_path, ctx):
    """``AllBlocksCleared`` only when the index is empty: blocks a running request holds stay cached."""
    llm = _llm(tmp_path, "tagged")
    sub = Subscriber(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "tagged", topic=b"kv")
    time.sleep(0.2)
    try:
        llm.generate([{"prompt_token_ids": list(range(10, 30))}], SamplingParams(max_tokens=2, temperature=0.0))
        eng = llm.engine
        eng.add_request(None, list(range(40, 60)), SamplingParams(max_tokens=20, temperature=0.0))
        eng.step()
        eng.step()
        llm.reset_prefix_cache()
        _settle(llm, sub)
        assert sub.n_events["AllBlocksCleared"] == 0
        assert sub.hashes == _index(llm) != set()
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        sub.close()
        llm.close()


# -- failures never reach the engine ---------------------------------------------------------------------------

def test_c30_publisher_failures_never_stop_the_engine(tmp_path, ctx, monkeypatch):
    llm = _llm(tmp_path, "tagged")
    try:
        import kvpage.cache.kv_events.publisher as publisher_mod

        def boom(*a, **k):
            raise RuntimeError("encoder broke")

        monkeypatch.setattr(publisher_mod, "to_wire", boom)  # the publisher thread fails every batch
        out = llm.generate([{"prompt_token_ids": list(range(1, 20))}], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 4
        sink = llm.engine.kv_events.sink
        assert sink.flush(5.0) and sink.num_failed >= 1 and sink.num_published == 0

        def raising(records):
            raise RuntimeError("sink broke")

        monkeypatch.setattr(sink, "publish", raising)  # even a sink that raises on the engine's thread
        out = llm.generate([{"prompt_token_ids": list(range(30, 50))}], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_c30_full_queue_drops_a_batch_and_leaves_a_sequence_gap(tmp_path, monkeypatch):
    import kvpage.cache.kv_events.publisher as publisher_mod

    real = publisher_mod.to_wire

    def slow(*a, **k):
        time.sleep(0.05)  # a publisher thread that cannot keep up
        return real(*a, **k)

    monkeypatch.setattr(publisher_mod, "to_wire", slow)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/q", max_queue_size=1)
    pub = ZmqEventPublisher(cfg, block_size=2)
    try:
        start = time.monotonic()
        seqs = [pub.publish([("GPU", BlockRemoved(H1, 0))]) for _ in range(20)]
        assert time.monotonic() - start < 0.5  # the engine's thread never waited for the slow publisher
        assert pub.flush(5.0)
        assert pub.num_dropped == seqs.count(None) >= 10 and pub.num_published == 20 - pub.num_dropped
        assert seqs[0] == 0 and None in seqs  # numbered when queued: a dropped batch is a gap subscribers see
    finally:
        pub.close()


# -- settings ---------------------------------------------------------------------------------------------------

def test_c30_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"kv_events_config has unknown keys \['bogus'\]"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "bogus": 1})
    with pytest.raises(ValueError, match="kv_events_config is not valid JSON"):
        EngineConfig(kv_events_config="{nope")
    with pytest.raises(ValueError, match="kv_events_config.encoding must be one of tagged, array"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "encoding": "json"})
    with pytest.raises(ValueError, match="kv_events_config.buffer_steps must be a positive integer"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="kv_events_config.publisher must be one of zmq, null"):
        KVEventsConfig(publisher="kafka")
    assert KVEventsConfig().publisher == "null" and KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events.endpoint == "tcp://*:5557"
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": False}).kv_events is None
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}).kv_events is None


def test_c30_endpoint_in_use_is_a_clear_error(tmp_path):
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(ValueError, match=rf"kv_events_config.endpoint='tcp://\*:{port}': cannot bind"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"), 4)
    finally:
        s.close()


def test_c30_cli_flag_parses_json_and_reaches_llm(monkeypatch):
    from kvpage.cli import engine_flags

    p = argparse.ArgumentParser()
    engine_flags.add_engine_args(p)
    args = p.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}'])
    assert args.kv_events_config == {"enable_kv_cache_events": True, "topic": "kv"}
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-events-config", "{oops"])
    seen = {}

    class FakeLLM:
        def __init__(self, model, **kw):
            seen.update(kw)

    import kvpage.engine.llm as llm_mod

    monkeypatch.setattr(llm_mod, "LLM", FakeLLM)
    engine_flags.build_llm(args)
    assert seen["kv_events_config"] == {"enable_kv_cache_events": True, "topic": "kv"}
    seen.clear()
    engine_flags.build_llm(p.parse_args([]))
    assert "kv_events_config" not in seen and "kv_cache_dtype" in seen


# -- tiers: medium tells the device from the host, disk and remote tiers ---------------------------------------

class MediumSubscriber(Subscriber):
    """Rebuilds one set of hashes per ``medium`` (the tiers' BlockStored carry no tokens, as vLLM's offloading
    connector sends them; the device's keep C30's checks)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.by_medium: dict[str, set[Any]] = {}
        self.stored_by_medium: dict[str, int] = {}
        self.removed_by_medium: dict[str, int] = {}

    def _apply(self, seq: int, payload: bytes) -> None:
        super()._apply(seq, payload)  # the device set, C30's checks, the sequence
        batch = self.decoder.decode(payload)
        for ev in batch.events:
            kind = type(ev).__name__.removesuffix("T")
            if kind == "AllBlocksCleared":  # vLLM's clear has no medium: the device's
                self.by_medium["GPU"] = set()
                continue
            got = self.by_medium.setdefault(ev.medium, set())
            if kind == "BlockStored":
                assert ev.block_size == 4
                if ev.medium != "GPU":
                    assert ev.token_ids == [] and ev.parent_block_hash is None
                self.stored_by_medium[ev.medium] = self.stored_by_medium.get(ev.medium, 0) + len(ev.block_hashes)
                got.update(ev.block_hashes)
            else:
                assert set(ev.block_hashes) <= got, f"{ev.medium}: removal of a block never stored"
                self.removed_by_medium[ev.medium] = self.removed_by_medium.get(ev.medium, 0) + len(ev.block_hashes)
                got.difference_update(ev.block_hashes)


def _tier_llm(tmp_path, ctx, **tiers: Any) -> tuple[LLM, MediumSubscriber]:
    """The tiny engine with events on (hashes as bytes) and ``tiers`` (its tier arguments), and a subscriber to it."""
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub", "block_hash_format": "bytes",
           "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv"}
    llm = LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=4, num_blocks=24, max_num_seqs=4,
              attention_backend="reference", progress=False, kv_events_config=cfg, **tiers)
    sub = MediumSubscriber(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "tagged", topic=b"kv")
    time.sleep(0.2)
    return llm, sub


def test_c30_tier_events_rebuild_device_host_and_disk_indexes(tmp_path, ctx):
    """With a host tier (write_through, smaller than the workload: it evicts) and a disk store, a subscriber's
    per-medium sets equal the device index ("GPU"), the host tier's index ("CPU") and the disk store's records
    ("DISK"); the device set is C30's."""
    probe = LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=4, num_blocks=24, progress=False,
                attention_backend="reference")
    host_gib = 40 * probe.spec.bytes_per_block / (1 << 30)  # 40 host blocks
    probe.close()
    llm, sub = _tier_llm(tmp_path, ctx, swap_space=host_gib, kv_offload_policy="write_through",
                         kv_disk_dir=str(tmp_path / "disk"))
    rng = random.Random(33)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    offload = llm.kv_connector.offload
    disk = offload.stores[0][1]
    try:
        for round_ in range(4):
            llm.generate(_workload(rng, 50), params)
            _settle(llm, sub)
            assert sub.hashes == _index(llm) == sub.by_medium["GPU"], f"round {round_}"
            assert sub.by_medium["CPU"] == set(offload.host._index), f"round {round_}"
            assert len(sub.by_medium["DISK"]) == len(disk) and all(disk.exists([disk.key(h) for h in
                                                                                  sub.by_medium["DISK"]]))
        assert offload.host.num_evictions > 20  # the host tier evicted (40 blocks)
        assert sub.removed_by_medium["CPU"] == offload.host.num_evictions
        assert sub.stored_by_medium["CPU"] >= len(offload.host._index) + offload.host.num_evictions
        assert llm.kv_cache_stats().tiers.tier_hits["host"] > 0  # loads from the host tier happened
        assert "DISK" not in sub.removed_by_medium  # an uncapped disk store evicts nothing
        assert sub.seqs == list(range(len(sub.seqs)))
    finally:
        sub.close()
        llm.close()


def test_c30_serve_shutdown_flushes_and_closes_the_publisher(tmp_path, ctx, monkeypatch):
    """``kvpage serve``'s shutdown closes the LLM it built: the publisher sends its queued batches (the last one
    included) and closes its sockets."""
    import uvicorn
    from fastapi.testclient import TestClient

    import kvpage.cli.serve as serve_mod

    made: list[LLM] = []
    sinks: list[ZmqEventPublisher] = []

    def tiny_llm(args, **kw):
        made.append(_llm(tmp_path, "tagged"))
        sinks.append(made[-1].engine.kv_events.sink)
        return made[-1]

    sub = Subscriber(ctx, f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "tagged", topic=b"kv")

    def run(self, sockets=None):  # uvicorn's run: startup, one request, shutdown (the lifespan's)
        with TestClient(self.config.app) as client:
            time.sleep(0.2)  # the subscription reaches the publisher
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello paged world, " * 3,
                                                     "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text

    monkeypatch.setattr(serve_mod, "build_llm", tiny_llm)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    p = argparse.ArgumentParser()
    serve_mod.add_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--port", "0", "--served-model-name", "tiny"])
    try:
        assert args.func(args) == 0
        sink = sinks[0]
        assert made[0].engine.kv_events is None  # the LLM was closed by the app's shutdown
        assert sink._pub.closed and not sink._thread.is_alive()  # sockets closed, thread stopped
        assert sink._queue.unfinished_tasks == 0 and sink.num_dropped == 0 and sink.num_published > 0
        sub.drain()
        pool = made[0].engine.kv.pool
        index = {_wire_hash(h, "int") for h in map(pool.block_hash, range(pool.num_blocks)) if h is not None}
        assert sub.n_events["BlockStored"] > 0 and sub.hashes == index  # the last batch arrived
        assert sub.seqs == list(range(sink.num_published))
    finally:
        sub.close()


def test_c30_redis_store_events_are_remote_stores_only(tmp_path, ctx, redis_url):
    """The Redis store's writes go out as ``BlockStored`` of medium ``"REMOTE"`` (hashes alone), each one a record
    the store holds; no removal is sent (Redis expires and evicts keys unseen), and no host tier: no ``"CPU"``."""
    llm, sub = _tier_llm(tmp_path, ctx, kv_store=redis_url)
    store = llm.kv_connector.offload.stores[0][1]
    try:
        llm.generate(_workload(random.Random(34), 40), SamplingParams(max_tokens=3, temperature=0.0))
        _settle(llm, sub)
        assert sub.hashes == _index(llm)
        remote = sub.by_medium["REMOTE"]
        assert len(remote) > 20 and all(store.exists([store.key(h) for h in remote]))
        assert set(sub.by_medium) == {"GPU", "REMOTE"} and "REMOTE" not in sub.removed_by_medium
    finally:
        sub.close()
        llm.close()


def test_c30_store_writes_a_store_drops_are_neither_announced_nor_counted(tmp_path, ctx):
    """A disk store capped below one record drops every write (its ``put`` says so): no ``"DISK"`` BlockStored goes
    out and the tiers count no ``store_write`` bytes, while the device's events are unchanged. (Before, every
    save was announced and counted whatever the store did, so a router saw records no store held.)"""
    llm, sub = _tier_llm(tmp_path, ctx, kv_disk_dir=str(tmp_path / "disk"), kv_disk_max_bytes=100)
    disk = llm.kv_connector.offload.stores[0][1]
    try:
        llm.generate(_workload(random.Random(35), 20), SamplingParams(max_tokens=3, temperature=0.0))
        _settle(llm, sub)
        assert sub.hashes == _index(llm) and len(sub.hashes) > 5  # device events as ever
        assert len(disk) == 0 and disk.stats.puts == 0
        assert "DISK" not in sub.by_medium
        assert llm.kv_cache_stats().tiers.tier_bytes["store_write"] == 0
    finally:
        sub.close()
        llm.close()
