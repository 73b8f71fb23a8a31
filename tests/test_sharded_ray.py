"""Symbols sharded over Ray actors on a local Ray cluster of two nodes (ray.cluster_utils starts both on this
machine; CPU actors, one per node; tiny preset): the predictions of one engine, symbols on both nodes, each
symbol's order kept with many steps in flight, a node killed mid-stream failing its symbols alone with the
message (or, with reset, starting them again from a fresh state), and the command lines on the cluster.

One cluster serves the whole module (a Ray node costs seconds and memory; CI has 2 cores)."""
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests need the extra: pip install -e '.[test]'")

from ray.cluster_utils import Cluster  # noqa: E402

from client.engine.fast import FastEngine  # noqa: E402
from client.engine.reference import ReferenceEngine  # noqa: E402
from client.engine.shard_ray import ray_shards, shard_count  # noqa: E402
from client.engine.sharded import ModelSpec, ShardedEngine, ShardError, ShardLost, ShardStartError  # noqa: E402
from client.model import load_model  # noqa: E402
from team.example_model import ExampleModel  # noqa: E402
from conftest import checkout_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = ModelSpec("tiny", seed=3)
# A dead node noticed in about a second, not Ray's default half minute.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 2}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_NODE_DEATH})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="warning")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=3)[0]


def start(cluster, engine, on_shard_loss="error", progress=False):
    options = {"capacity": 16} if engine == "fast" else {}
    return ShardedEngine(ray_shards(SPEC, cluster.address, device="cpu", engine=engine, options=options,
                                    progress=False), on_shard_loss=on_shard_loss, progress=progress, transport="ray")


def features_for(rng, count):
    return rng.standard_normal((count, 79)).astype(np.float32)


class TestOneEngineOnTwoNodes:
    """One engine's shards for these tests, stopped after them (each shard takes its node's CPU)."""

    @pytest.fixture(scope="class")
    def fast_shards(self, cluster):
        engine = start(cluster, "fast")
        yield engine
        engine.close()

    def test_predictions_equal_one_engine_and_symbols_spread_over_both_nodes(self, cluster, model, fast_shards):
        single = FastEngine(model, "cpu", capacity=16, progress=False)
        rng = np.random.default_rng(0)
        symbols = [f"S{i}" for i in range(6)]
        for _ in range(4):
            chosen = [str(s) for s in rng.choice(symbols, 4, replace=False)]
            features = features_for(rng, 4)
            # a shard steps its part of the batch alone, and a product of fewer rows may round differently
            np.testing.assert_allclose(fast_shards.step(chosen, features), single.step(chosen, features),
                                       rtol=0, atol=1e-4)
        nodes = {shard.info["node_id"] for shard in fast_shards.shards}
        assert nodes == {node["NodeID"] for node in ray.nodes() if node["Alive"]} and len(nodes) == 2
        held = [sum(index == shard for index in fast_shards.shard_of.values()) for shard in range(2)]
        assert sorted(held) == [3, 3]  # placed by load: each node holds symbols

    def test_steps_in_flight_keep_each_symbols_order(self, model, fast_shards):
        single = FastEngine(model, "cpu", capacity=16, progress=False)
        rng = np.random.default_rng(1)
        symbols = ["O0", "O1", "O2", "O3"]
        steps = [features_for(rng, 4) for _ in range(12)]
        pending = [fast_shards.submit(symbols, features) for features in steps]  # none collected yet
        for step, features in zip(pending, steps):
            np.testing.assert_allclose(step.result(), single.step(symbols, features), rtol=0, atol=1e-4)


    def test_a_symbols_state_exported_and_imported_in_order_with_its_steps(self, model, fast_shards):
        alone = FastEngine(model, "cpu", capacity=16, progress=False)
        assert fast_shards.state_layout() == alone.state_layout()
        rng = np.random.default_rng(3)
        features = [features_for(rng, 1) for _ in range(3)]
        fast_shards.step(["X0"], features[0])
        alone.step(["X0"], features[0])
        first = fast_shards.submit(["X0"], features[1])
        exported = fast_shards.export_state("X0")  # between two steps in flight
        second = fast_shards.submit(["X0"], features[2])
        alone.step(["X0"], features[1])
        assert np.array_equal(exported.result(), alone.export_state("X0").result())
        first.result(), second.result()
        assert fast_shards.export_state("never seen").result() is None
        fast_shards.import_state("X1", exported.result())
        alone.import_state("X1", exported.result())
        assert np.array_equal(fast_shards.step(["X1"], features[2]), alone.step(["X1"], features[2]))
        fast_shards.release(["X0", "X1"])

    def test_a_symbols_several_requests_in_one_step_go_to_its_node_in_order(self, model, fast_shards):
        one_at_a_time = FastEngine(model, "cpu", capacity=16, progress=False)
        symbols = ["M0", "M1", "M0", "M2", "M1", "M0", "M3", "M3"]
        features = features_for(np.random.default_rng(9), len(symbols))
        predictions = fast_shards.step(symbols, features)
        assert len({fast_shards.shard_of[s] for s in symbols}) == 2  # split over both nodes
        for row, symbol in enumerate(symbols):
            np.testing.assert_allclose(predictions[row], one_at_a_time.step([symbol], features[row:row + 1])[0],
                                       rtol=0, atol=1e-4)


    def test_a_part_that_cannot_be_sent_fails_alone_and_its_shard_keeps_serving(self, fast_shards):
        """A part whose call Ray cannot make (an argument it cannot serialize) fails alone; the shard's next
        calls are still taken (each is taken in its sequence number's turn, and that one never came)."""
        class Unsendable(str):
            def __reduce_ex__(self, protocol):
                raise TypeError("not serializable")

        features = np.zeros((1, 79), np.float32)
        with pytest.raises(ShardError, match="not serializable"):
            fast_shards.step([Unsendable("U0")], features)
        after = fast_shards.submit(["U0"], features)  # on the same shard
        waiting = threading.Thread(target=after.result, daemon=True)
        waiting.start()
        waiting.join(timeout=60)
        assert not waiting.is_alive(), "the shard took no call after the one that was not sent"
        assert after.result().shape == (1, 4)


def _kill_worker_node(cluster, engine):
    """Kill the cluster's worker node (not the head) with its shard; wait until Ray knows it is dead. Returns
    the index of the shard that was on it."""
    node = cluster.list_all_nodes()[-1]
    index = next(s.index for s in engine.shards if s.info["node_id"] == node.node_id)
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "Ray did not notice the node's death within 60 s"
        time.sleep(0.2)
    return index


def test_a_node_killed_mid_stream_fails_its_symbols_alone(cluster, model, capsys):
    engine = start(cluster, "reference", progress=True)
    try:
        team = ExampleModel(engine)
        single = ReferenceEngine(model)
        rng = np.random.default_rng(2)
        symbols = [f"K{i}" for i in range(6)]
        uid = iter(range(10**6))
        for _ in range(3):
            features = features_for(rng, 6)
            answer = team.process_batch({s: (next(uid), f) for s, f in zip(symbols, features)})
            assert not answer["errors"]
            np.testing.assert_allclose(answer["predictions"], single.step(symbols, features), rtol=0, atol=1e-5)
        lost_shard = _kill_worker_node(cluster, engine)
        lost = [s for s in symbols if engine.shard_of[s] == lost_shard]
        kept = [s for s in symbols if s not in lost]
        assert len(lost) == 3
        for _ in range(3):
            features = features_for(rng, 6)
            requests = {s: (next(uid), f) for s, f in zip(symbols, features)}
            answer = team.process_batch(requests)
            assert sorted(answer["errors"]) == sorted(requests[s][0] for s in lost)
            assert all(f"shard {lost_shard} (Ray actor on node" in why and "lost: ActorDiedError: the actor died"
                       in why for why in answer["errors"].values())
            assert answer["unique_ids"] == [requests[s][0] for s in kept]  # every other symbol keeps playing
            kept_rows = [symbols.index(s) for s in kept]
            np.testing.assert_allclose(answer["predictions"], single.step(kept, features[kept_rows]), rtol=0,
                                       atol=1e-5)
        err = capsys.readouterr().err
        line = next(line for line in err.splitlines() if line.startswith("[sharded engine] shard"))
        assert f"shard {lost_shard} (Ray actor on node" in line and "lost: ActorDiedError: the actor died" in line
        assert line.endswith(f"its 3 symbol(s) {', '.join(lost)} get errors from now on (--on-shard-loss error)")
        assert len(engine.losses) == 1 and engine.losses[0]["symbols"] == lost
        with pytest.raises(ShardLost, match=f"shard {lost_shard} .* lost"):
            engine.step(lost[:1], features_for(rng, 1))
        engine.step(["NEW"], features_for(rng, 1))
        assert engine.shard_of["NEW"] != lost_shard  # new symbols go to the shards left
    finally:
        engine.close()
        cluster.add_node(num_cpus=1)  # the next tests want two nodes again
        cluster.wait_for_nodes()


def test_reset_starts_a_lost_nodes_symbols_again_from_a_fresh_state(cluster, model):
    engine = start(cluster, "reference", on_shard_loss="reset")
    try:
        single = ReferenceEngine(model)
        rng = np.random.default_rng(3)
        symbols = [f"R{i}" for i in range(4)]
        features = features_for(rng, 4)
        np.testing.assert_allclose(engine.step(symbols, features), single.step(symbols, features), rtol=0, atol=1e-5)
        lost_shard = _kill_worker_node(cluster, engine)
        lost = [s for s in symbols if engine.shard_of[s] == lost_shard]
        fresh = ReferenceEngine(model)  # what a fresh state predicts
        for _ in range(2):
            features = features_for(rng, 4)
            predictions = engine.step(symbols, features)
            for row, symbol in enumerate(symbols):
                reference = fresh if symbol in lost else single
                np.testing.assert_allclose(predictions[row], reference.step([symbol], features[row:row + 1])[0],
                                           rtol=0, atol=1e-5)
        survivor = 1 - lost_shard
        assert engine.losses[0]["moved_to"] == {s: survivor for s in lost}
        assert f"start again from a fresh state on shard(s) {survivor} (--on-shard-loss reset)" in \
            engine.losses[0]["line"]
    finally:
        engine.close()
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()


def test_random_streams_served_through_symbols_sharded_over_two_nodes_equal_one_request_at_a_time(cluster):
    """tests/test_served_fuzz.py's driver (the scoring server, its corrupting relay, the team client's runtime)
    through a shard on each node, each forgetting symbols idle: every answer that of the symbol's requests stepped
    one at a time (from a fresh state where its shard forgot it), and the shards' CPUs free again once closed."""
    from test_served_fuzz import SEED, served_sharded, shard_options

    total = ray.cluster_resources()["CPU"]
    shards = ray_shards(ModelSpec("tiny", seed=SEED), cluster.address, device="cpu", engine="fast",
                        options=shard_options(idle=True), progress=False)
    served_sharded("ws", shards, 10, load_model("tiny", seed=SEED), idle=True)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < total:  # the actors are gone
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_shards_a_busy_cluster_cannot_hold_are_refused_in_one_line(cluster, monkeypatch):
    """Another client's shards hold every node's CPUs: a second client's actors waited, unsaid, for the start
    timeout (ten minutes by default) where the cluster can be seen to lack them."""
    from client.engine import shard_ray

    monkeypatch.setattr(shard_ray, "FREE_WAIT_S", 1.0)
    first = start(cluster, "reference")
    try:
        started = time.monotonic()
        with pytest.raises(ShardStartError, match=re.escape(
                f"the Ray cluster at {cluster.address} cannot hold 2 shard(s) now: 0 of 2 CPU(s) free, 2 needed "
                f"(another client's shards hold theirs until it exits")):
            ray_shards(SPEC, cluster.address, device="cpu", engine="reference", progress=False, start_timeout_s=60)
        assert time.monotonic() - started < 30
    finally:
        first.close()


def test_a_cpu_shard_goes_to_a_node_with_its_cpus_free(cluster):
    """Another client's shard holds one node's CPU: a client asking for one shard was pinned to the first node
    whatever was free there, and its actor waited, unsaid, for the start timeout (ten minutes by default) beside
    a free node."""
    first = ShardedEngine(ray_shards(SPEC, cluster.address, 1, device="cpu", engine="reference", progress=False),
                          progress=False)
    try:
        deadline = time.monotonic() + 10
        while ray.available_resources().get("CPU", 0) > 1:  # the cluster's view has the first shard's CPU held
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.1)
        started = time.monotonic()
        second = ray_shards(SPEC, cluster.address, 1, device="cpu", engine="reference", progress=False,
                            start_timeout_s=30)
        for shard in second:
            shard.stop()
        assert time.monotonic() - started < 20
        assert second[0].info["node_id"] != first.shards[0].info["node_id"]
    finally:
        first.close()


def test_shards_a_node_cannot_hold_are_refused_in_one_line(monkeypatch):
    """A CPU shard is pinned to its node: one whose CPUs another client holds was let through where the cluster
    had as many free elsewhere, and its actor waited, unsaid, for the start timeout."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from client.engine import shard_ray

    class FakeRay:
        _private = type("private", (), {"state": type("state", (), {"available_resources_per_node": staticmethod(
            lambda: {"a" * 56: {"CPU": 1.0}, "b" * 56: {"CPU": 2.0}})})})

        @staticmethod
        def available_resources():
            return {"CPU": 3.0}

        @staticmethod
        def cluster_resources():
            return {"CPU": 4.0}

    monkeypatch.setattr(shard_ray, "FREE_WAIT_S", 0.5)
    placements = [{"num_cpus": 2, "scheduling_strategy": NodeAffinitySchedulingStrategy("a" * 56, soft=False)}]
    with pytest.raises(ShardStartError, match=re.escape(
            "the Ray cluster at head:6379 cannot hold 1 shard(s) now: node aaaaaaaa has 1 CPU(s) free, 2 needed "
            "(another client's shards hold theirs until it exits")):
        shard_ray._wait_free(FakeRay(), placements, "head:6379")


def test_a_relative_checkpoint_path_is_the_clients_folders(cluster, tmp_path, monkeypatch):
    """--weights PATH relative to the folder the client runs in: the shards load that path (the same on each
    host), not PATH in their workers' folder (where their node's Ray was started)."""
    import torch

    from client.model import get_preset
    from client.weights import make_weights

    torch.save(make_weights(get_preset("tiny"), seed=3), tmp_path / "w.pt")
    monkeypatch.chdir(tmp_path)  # not where this cluster's nodes were started
    engine = ShardedEngine(ray_shards(ModelSpec("tiny", "w.pt"), cluster.address, 1, device="cpu",
                                      engine="reference", progress=False), progress=False)
    try:
        assert engine.fingerprint == load_model("tiny", seed=3)[1]
    finally:
        engine.close()


def test_gpu_shards_of_a_node_share_its_host_memory(cluster, monkeypatch):
    """An actor per GPU: the fast engines of a node's GPUs split its host tier's budget between them (as shard
    processes on one machine do), where each counted all of the node's memory as its own and pinned it. Run here
    in-process, on a node said to have 4 GPUs, with the engine's build stubbed."""
    import client.engine.fast.state_table as state_table
    from client.engine import shard_ray

    node_id = ray.get_runtime_context().get_node_id()
    nodes = [{**node, "Resources": {**node["Resources"], "GPU": 4.0}} if node["NodeID"] == node_id else node
             for node in ray.nodes()]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(state_table, "host_tier_budget", lambda: 8 * 2**30)
    built = []
    monkeypatch.setattr(shard_ray, "build_shard_engine",
                        lambda spec, device, engine, options: (built.append(options), ({}, {}))[1])
    for options in ({"capacity": 16}, {"host_symbols": 100}):
        asyncio.run(shard_ray.ShardActor().start(SPEC, "cuda", "fast", options))
    assert built == [{"capacity": 16, "host_memory": 2 * 2**30}, {"host_symbols": 100}]  # a size given is kept


def test_an_actor_unreachable_when_its_node_dies_is_said_in_a_few_words():
    """A node killed under its actor mostly reads as unreachable: Ray's message was cut mid-word and called the
    actor temporarily unavailable, where the shard is lost for good."""
    from client.engine.shard_ray import _reason

    exc = ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable: RpcError: RPC error: "
                                               "recvmsg:Connection reset by peer rpc_code: 14", b"\x8d" * 16)
    assert _reason(exc) == ("ActorUnavailableError: the actor could not be reached (RpcError: RPC error: "
                            "recvmsg:Connection reset by peer rpc_code: 14), and whether its last steps ran is not "
                            "known")


def test_killing_a_lost_shard_leaves_ray_up_for_the_others_and_its_stop():
    """The engine kills a shard at its loss: Ray, started by this client, stays up until the last shard stops."""
    from client.engine.shard_ray import RayShard, _Connection

    calls = []

    class FakeRay:
        def kill(self, actor, no_restart):
            calls.append(("kill", actor))

        def shutdown(self):
            calls.append(("shutdown",))

    connection = _Connection(FakeRay(), owned=True)
    connection.open_shards = 1
    shard = RayShard(0, "actor", connection)
    shard.kill()
    assert calls == [("kill", "actor")]
    shard.stop()
    assert calls[-1] == ("shutdown",)


def test_shard_counts_and_what_a_cluster_cannot_hold():
    assert shard_count("cuda", None, 4, 2, "head:6379") == 4  # every GPU by default
    assert shard_count("cpu", None, 0, 3, "head:6379") == 3   # one per node without GPUs
    assert shard_count("cpu", 5, 0, 2, "head:6379") == 5
    with pytest.raises(ValueError, match=r"--shards 3: the Ray cluster at head:6379 has 2 GPU\(s\), one shard each"):
        shard_count("cuda", 3, 2, 2, "head:6379")
    with pytest.raises(ValueError, match="--device cuda: the Ray cluster at head:6379 has no GPU; use --device cpu"):
        shard_count("cuda", None, 0, 2, "head:6379")
    # each actor steps on the GPU Ray gives it: a GPU's index was dropped unsaid
    with pytest.raises(ValueError, match=re.escape("--device cuda:1: Ray shards run on cuda (each on the GPU Ray "
                                                   "gives it) or cpu")):
        shard_count("cuda:1", None, 4, 2, "head:6379")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(args, timeout=300):
    env = checkout_env(REPO)
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_local_starts_ray_here_where_this_machine_has_joined_a_cluster():
    """--ray-address local (the default) joined the cluster of RAY_ADDRESS, or the last one `ray start` joined
    here (the head, where the README runs the client), where it is to start a Ray instance of its own."""
    elsewhere = f"127.0.0.1:{_free_port()}"
    script = ("from client.engine.shard_ray import connect\n"
              "connection = connect('local')\n"
              "print(connection.ray.get_runtime_context().gcs_address)\n"
              "connection.ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**checkout_env(REPO), "RAY_ADDRESS": elsewhere})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] != elsewhere


def test_addresses_where_no_cluster_answers_are_one_line_within_seconds():
    """Each refused in one line within seconds, the team client's runs side by side: nothing listening at HOST:PORT
    (Ray Client's port is the head's --ray-client-server-port: --port there would have moved the GCS to it), or at
    auto's (RAY_ADDRESS's: waited for minutes, ray.init logging every few seconds); http:// (the dashboard's form:
    reached ray.init, whose error blamed a RAY_ADDRESS never set); something that answers there but is no Ray head's
    GCS, silent or HTTP (a dashboard's port, another service: ray.init waited about ten minutes)."""
    closed, auto = _free_port(), _free_port()
    listeners = {answer: socket.create_server(("127.0.0.1", 0)) for answer in ("silent", "http")}
    held = []

    def serve(listener, http):
        with listener:
            conn, _ = listener.accept()
            held.append(conn)
            if http:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    for answer, listener in listeners.items():
        threading.Thread(target=serve, args=(listener, answer == "http"), daemon=True).start()
    error = "team/example_model.py: error: "
    not_a_head = "something else answers there; give the head's GCS port"
    cases = [  # (--ray-address, RAY_ADDRESS, the last line's start)
        (f"127.0.0.1:{closed}", None, f"{error}no Ray cluster at --ray-address 127.0.0.1:{closed}: Connection "
                                      f"refused; start its head with `ray start --head --port {closed}`"),
        (f"ray://127.0.0.1:{closed}", None, f"{error}no Ray cluster at --ray-address ray://127.0.0.1:{closed}: "
                                            f"Connection refused; start its head with `ray start --head "
                                            f"--ray-client-server-port {closed}`"),
        ("auto", f"127.0.0.1:{auto}", f"{error}no Ray cluster at --ray-address auto ("),
        ("http://127.0.0.1:8265", None, f"{error}--ray-address http://127.0.0.1:8265: expected HOST:PORT (the head's "
                                        f"GCS port, 6379 by default), ray://HOST:PORT, auto or local"),
        *((f"127.0.0.1:{listener.getsockname()[1]}", None,
           f"{error}no Ray cluster at --ray-address 127.0.0.1:{listener.getsockname()[1]}: {not_a_head}")
          for listener in listeners.values()),
    ]
    env = {k: v for k, v in checkout_env(REPO).items() if k != "RAY_ADDRESS"}

    def run(case):
        address, ray_address, _ = case
        begun = time.monotonic()
        done = subprocess.run([sys.executable, "team/example_model.py", "--cluster", "ray", "--ray-address", address],
                              cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**env, **({"RAY_ADDRESS": ray_address} if ray_address else {})})
        return done, time.monotonic() - begun

    try:
        with ThreadPoolExecutor(len(cases)) as pool:
            runs = list(pool.map(run, cases))
    finally:
        for conn in held:
            conn.close()
    for (done, took), (address, _, said) in zip(runs, cases):
        assert done.returncode == 2, (address, done.stderr[-2000:])
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(said), (address, last)
        assert took < 60, (address, took)
    auto_said = runs[2][0].stderr.strip().splitlines()[-1]
    assert f":{auto}): Connection refused; start its head with `ray start --head --port {auto}`" in auto_said


TOKEN_CLUSTER = """
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
print(cluster.address, flush=True)
input()  # until the test is done
cluster.shutdown()
"""


def test_a_head_that_refuses_the_clients_token_is_one_line():
    """A head started with RAY_AUTH_MODE=token (the README's) and clients without its token: ray.init retried for
    20 s, logging each try, then said that no cluster was there (and without any token, aborted the process). One
    head; its three clients side by side: none with a token, a wrong one, token mode without one."""
    env = {k: v for k, v in checkout_env(REPO).items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    clients = [
        ({}, "it wants the cluster's token: run the client with RAY_AUTH_MODE=token, and the head's ~/.ray/auth_token"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "b" * 32}, "this client's token (RAY_AUTH_TOKEN, "
                                                                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is not the "
                                                                "cluster's"),
        ({"RAY_AUTH_MODE": "token", "HOME": "/nonexistent"}, "RAY_AUTH_MODE=token, but no token is here"),
    ]
    head = subprocess.Popen([sys.executable, "-c", TOKEN_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 32})
    try:
        address = head.stdout.readline().strip()
        started = time.monotonic()
        with ThreadPoolExecutor(len(clients)) as pool:
            done = list(pool.map(lambda client: subprocess.run(
                [sys.executable, "team/example_model.py", "--cluster", "ray", "--ray-address", address], cwd=REPO,
                capture_output=True, text=True, timeout=120, env={**env, **client[0]}), clients))
        took = time.monotonic() - started
    finally:
        head.communicate("\n", timeout=60)
    for run, (_, said) in zip(done, clients):
        assert run.returncode == 2, run.stderr[-2000:]
        assert run.stderr.strip().splitlines()[-1].startswith(
            f"team/example_model.py: error: the Ray cluster at --ray-address {address} refused this client: {said}")
    assert took < 18  # the three side by side, where each alone retried for 20 s


def test_team_client_on_the_cluster_says_a_reset_in_its_summary_and_on_the_leaderboard(cluster, tmp_path):
    """The team client plays its embedded server on the cluster; a node is killed mid-stream; with reset its
    symbols start again, the stream is played to the end, and the loss is in the client's summary and the
    server's (the leaderboard's) notices."""
    out = tmp_path / "summary.json"
    env = checkout_env(REPO)
    client = subprocess.Popen([sys.executable, "team/example_model.py", "--cluster", "ray", "--ray-address",
                               cluster.address, "--on-shard-loss", "reset", "--preset", "tiny", "--seed", "3",
                               "--symbols", "4", "--requests", "400", "--rate", "50", "--json", str(out)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = []
        for line in client.stderr:  # until the server has welcomed it
            said.append(line)
            if line.startswith("playing ws://"):
                break
        time.sleep(2.0)  # mid-stream
        cluster.remove_node(cluster.list_all_nodes()[-1], allow_graceful=False)
        stdout, rest = client.communicate(timeout=300)
    finally:
        client.kill()
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    stderr = "".join(said) + rest
    assert client.returncode == 0, stderr[-3000:]
    assert "2 shard(s) on CPUs (one per node, --device not given: the cluster has no GPU)" in stderr
    assert "engine reference in 2 Ray shard(s)" in stderr
    summary = json.loads(out.read_text())
    assert summary["outcome"] == "complete" and summary["responses"] + summary["missed"] == 400
    (notice,) = summary["notices"]
    assert notice["code"] == "state_reset" and "lost: ActorDiedError: the actor died" in notice["text"]
    assert "symbol(s) SYM_" in notice["text"] and "start again from a fresh state on shard(s)" in notice["text"]
    assert f"[sharded engine] {notice['text']}" in stderr  # and on stderr, in one line
    (server,) = json.loads(stdout.split("server summary: ", 1)[1])
    assert server["notices"] == [notice] and server["notices_total"] == 1


def test_evaluator_on_the_cluster_matches_the_reference(cluster, tmp_path, monkeypatch):
    import local_evaluator

    out = tmp_path / "eval.json"
    monkeypatch.setenv("FASTENS_CACHE", str(tmp_path / "cache"))
    code = local_evaluator.main(["--preset", "tiny", "--seed", "3", "--symbols", "4", "--requests", "60",
                                 "--cluster", "ray", "--ray-address", cluster.address, "--shards", "3",
                                 "--json", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["shards"] == 3 and summary["shard_losses"] == [] and summary["on_shard_loss"] == "error"
    assert all(tower["within_atol"] == 1.0 for tower in summary["towers"].values())


def test_bench_shards_section_on_the_cluster(cluster, tmp_path):
    out = tmp_path / "bench.json"
    done = _run(["scripts/bench.py", "--preset", "tiny", "--device", "cpu", "--quick", "--sections", "shards",
                 "--cluster", "ray", "--ray-address", cluster.address, "--rates", "50", "--rate-seconds", "1",
                 "--json", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["shards"].values()  # the cluster's default: one shard per node
    assert row["transport"] == "ray" and len(row["where"]) == 2 and row["losses"] == []
    assert all(where.startswith("Ray actor on node") for where in row["where"])
    assert row["runs"][0]["rate"] == 50 and row["runs"][0]["accuracy"] == 1.0
