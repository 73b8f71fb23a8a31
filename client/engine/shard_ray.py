"""Shards as Ray actors, on the hosts of a Ray cluster: one actor per GPU (num_gpus=1), or CPU actors on a cluster
without GPUs (one per node by default, each given its node's CPUs).

Each actor loads the model from the spec on its own host (a checkpoint path must exist there; synthetic weights
are made there), builds its engine and keeps its state table. The client sends it each step's part (symbols and
79 float32 features a row) and gets 4 float32 predictions a row back; nothing else crosses the network per step.
Whatever order an (async) actor's calls start in, each carries its sequence number and the actor takes them
strictly in that order (submit now, collect the result on one thread), so a symbol's requests can never be
reordered. A call whose actor or node died raises RayActorError: the shard is lost.

Ray is optional (the `ray` extra: `pip install ".[ray]"` in a checkout); this module imports it only when a
cluster is asked for.
"""
import asyncio
import dataclasses
import logging
import os
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from client.engine.sharded import (ModelSpec, Shard, ShardError, ShardLost, ShardStartError, build_shard_engine,
                                   import_answer, share_host_tier, submit_placeable, wait_started)

LOCAL = "local"           # --ray-address local: start a Ray instance on this machine
PROBE_TIMEOUT_S = 5.0     # how long a cluster's address may take to accept a connection, and to answer
FREE_WAIT_S = 10.0        # how long the shards may wait for the cluster's CPUs or GPUs to be free
REASON_CHARS = 200
# A client's HTTP/2 connection preface with an empty SETTINGS frame: a gRPC server answers with its SETTINGS.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError('--cluster ray needs Ray: pip install "ray>=2.9"') from exc
    return ray


class ShardActor:
    """A shard in a Ray actor: its engine and state table. Async, so that the next step is submitted while the
    last one's result is collected on the collector thread (a CUDA engine overlaps them); calls are taken in
    their sequence order whatever order they reach the actor in."""

    async def start(self, spec: ModelSpec, device: str, engine: str, options: dict) -> dict:
        import ray
        import torch

        context = ray.get_runtime_context()
        if device == "cuda":  # an actor per GPU: the node's GPU shards share its host memory
            node = next(node for node in ray.nodes() if node["NodeID"] == context.get_node_id())
            options = share_host_tier(options, engine, device, max(int(node["Resources"].get("GPU", 1)), 1))
        self.engine, info = build_shard_engine(spec, device, engine, options)
        self.collector = ThreadPoolExecutor(1, thread_name_prefix="shard-collect")  # results in submission order
        self.next_seq = 0
        self.turn = asyncio.Condition()
        gpus = ray.get_gpu_ids()
        return {**info, "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in gpus], "threads": torch.get_num_threads()}

    async def _in_turn(self, seq, action):
        async with self.turn:
            await self.turn.wait_for(lambda: self.next_seq == seq)
            try:
                return action()
            finally:
                self.next_seq += 1
                self.turn.notify_all()

    async def step(self, seq: int, symbols, features):
        # Ray hands arrays over read-only; engines take tensors of them
        features = np.require(features, requirements="W")
        pending = await self._in_turn(seq, lambda: submit_placeable(self.engine, symbols, features))
        return await asyncio.get_running_loop().run_in_executor(self.collector, pending.result)

    async def release(self, seq: int, symbols):
        await self._in_turn(seq, lambda: self.engine.release(symbols))

    async def export_state(self, seq: int, symbol):
        pending = await self._in_turn(seq, lambda: self.engine.export_state(symbol))
        return await asyncio.get_running_loop().run_in_executor(self.collector, pending.result)

    async def import_state(self, seq: int, symbol, data):
        return await self._in_turn(seq, lambda: import_answer(self.engine, symbol, data))


class _Connection:
    """This process's connection to Ray; shut down with the last shard when it was made here."""

    def __init__(self, ray, owned):
        self.ray, self.owned = ray, owned  # owned: ray.init was called here
        self.open_shards = 0

    def shard_stopped(self):
        self.open_shards -= 1
        if self.open_shards == 0 and self.owned:
            self.ray.shutdown()


class RayShard(Shard):
    def __init__(self, index, actor, connection):
        self.index, self.actor, self.connection = index, actor, connection
        self.where = "Ray actor (starting)"
        self.info = None
        self._next_seq = 0
        self._stopped = False

    def ready(self, info):
        self.info = info
        device = f"GPU {','.join(info['gpus'])}" if info["gpus"] else f"cpu, {info['threads']} thread(s)"
        self.where = f"Ray actor on node {info['node_id'][:8]} at {info['ip']}, {device}"

    def _call(self, method, *args):
        """method.remote with the next sequence number, taken only once the call is made: the actor waits for each
        number's turn, so one skipped (a call Ray could not make, e.g. an argument it cannot serialize) would hold
        every later call of this shard for ever."""
        handle = method.remote(self._next_seq, *args)
        self._next_seq += 1
        return handle

    def submit(self, symbols, features):
        return self._call(self.actor.step, symbols, features)

    def result(self, handle):
        ray = self.connection.ray
        try:
            return ray.get(handle)
        except ray.exceptions.RayActorError as exc:  # the actor or its node died, or it is unreachable
            raise ShardLost(_reason(exc)) from None
        except ray.exceptions.RayTaskError as exc:  # the step raised in the actor: this part fails alone
            cause = exc.cause if exc.cause is not None else exc
            raise ShardError(f"shard {self.index}: {type(cause).__name__}: {cause}") from None

    def release(self, symbols):
        self._call(self.actor.release, symbols)

    def export_state(self, symbol):
        return self._call(self.actor.export_state, symbol)

    def import_state(self, symbol, data):
        return self._call(self.actor.import_state, symbol, data)

    def kill(self):
        # the connection stays up for the other shards, and for close(): Ray is shut down only by the last stop
        try:
            self.connection.ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone with its node
            pass

    def stop(self):
        if self._stopped:
            return
        self._stopped = True
        self.kill()
        self.connection.shard_stopped()


def _reason(exc) -> str:
    """Why an actor call failed, in one short line (Ray's message runs to several lines of ids)."""
    text = " ".join(str(exc).split())
    because = text.find("The actor is dead because ")
    if because >= 0:  # "... because its node has died." / "its worker process has died." / "it was killed ..."
        clause = text[because + len("The actor is dead because "):].split(". ")[0].rstrip(".")
        return f"{type(exc).__name__}: the actor died, {clause}"
    # Ray's "The actor ID is unavailable: The actor is temporarily unavailable: RpcError: ... . The task may or
    # may not have been executed on the actor.", cut mid-word at REASON_CHARS, read as if the shard would come back
    unreachable = re.search(r"is unavailable: (?:The actor is temporarily unavailable: )?(.*?)\.? The task may or "
                            r"may not have been executed", text)
    if unreachable:
        return (f"{type(exc).__name__}: the actor could not be reached ({unreachable.group(1)[:REASON_CHARS]}), and "
                f"whether its last steps ran is not known")
    first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    first = first[:1].lower() + first[1:]  # "The actor died unexpectedly before finishing this task"
    return f"{type(exc).__name__}: {first[:REASON_CHARS]}"


def connect(address: str):
    """Ray, connected to the cluster at `address` (`local`: a Ray instance started on this machine; `auto`: the
    one running here; HOST:PORT or ray://HOST:PORT). A process already connected to that cluster (or asking
    for `auto`) keeps its connection."""
    ray = import_ray()
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in ("auto", current):
            raise ValueError(f"--ray-address {address}: this process is already connected to the Ray cluster at "
                             f"{current}")
        return _Connection(ray, owned=False)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address == LOCAL:
        # Ray's own "local": without an address ray.init joins RAY_ADDRESS's cluster, or the last one started here
        ray.init(address=LOCAL, include_dashboard=False, **quiet)
        return _Connection(ray, owned=True)
    # auto: the cluster Ray would join (RAY_ADDRESS's, the last head started here), checked as one given is: one gone
    # since was waited for minutes
    target = _auto_address(ray) if address == "auto" else address
    if target is not None:
        said = address if target == address else f"auto ({target})"
        _probe(target, said)
        if "://" not in target:  # a head's GCS, not Ray Client's server
            _check_token(ray, target, said)
    try:
        ray.init(address=address, **quiet)
    except ConnectionError as exc:
        raise ConnectionError(f"no Ray cluster at --ray-address {address}: {exc}") from None
    return _Connection(ray, owned=True)


def _auto_address(ray) -> str | None:
    """HOST:PORT of the cluster `--ray-address auto` joins; None where Ray reads another form there (ray://), for
    ray.init to say."""
    try:
        return ray._private.services.canonicalize_bootstrap_address("auto")
    except ConnectionError as exc:  # none found
        raise ConnectionError(f"no Ray cluster at --ray-address auto: {exc}") from None
    except ValueError:
        return None


def _probe(address: str, said: str):
    """Fail in one line, and fast, where nothing listens at the address (ray.init would retry for minutes); `said`:
    the address as given."""
    scheme, _, host_port = address.rpartition("://")
    host, _, port = host_port.rpartition(":")
    if scheme not in ("", "ray") or not host or not port.isdigit():  # http://: Ray's error blamed RAY_ADDRESS
        raise ValueError(f"--ray-address {said}: expected HOST:PORT (the head's GCS port, 6379 by default), "
                         f"ray://HOST:PORT, auto or local")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        # Ray Client's server is the head's too, on a port of its own (--port would move the GCS there)
        start = f"--ray-client-server-port {port}" if scheme else f"--port {port}"
        raise ConnectionError(f"no Ray cluster at --ray-address {said}: {why}; start its head with "
                              f"`ray start --head {start}`, or use --ray-address local") from None
    with sock:
        grpc = _speaks_grpc(sock)
    if not grpc:  # ray.init would wait for a GCS there for about ten minutes, logging every half minute
        raise ConnectionError(f"no Ray cluster at --ray-address {said}: something else answers there; give the "
                              f"head's GCS port (6379 by default; the dashboard's 8265 is another), or "
                              f"ray://HOST:10001 for Ray Client")


def _check_token(ray, address: str, said: str):
    """Fail in one line, and fast, where the head refuses this process's token: ray.init retried for 20 s, logging
    each try, then said that no cluster was there."""
    refused = getattr(ray.exceptions, "AuthenticationError", None)
    if refused is None:  # a Ray without token authentication (before 2.52)
        return
    token_mode = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    found = False
    try:
        from ray._raylet import AuthenticationTokenLoader, GcsClient

        if token_mode:  # raises where there is none: GcsClient would abort the process
            found = AuthenticationTokenLoader.instance().has_token()
        GcsClient(address=address)  # asks the GCS its cluster id, with this process's token as ray.init would
    except refused:
        if not token_mode:
            why = ("it wants the cluster's token: run the client with RAY_AUTH_MODE=token, and the head's "
                   "~/.ray/auth_token here")
        elif found:
            why = ("this client's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) is not the "
                   "cluster's: copy the head's ~/.ray/auth_token here")
        else:
            why = "RAY_AUTH_MODE=token, but no token is here: copy the head's ~/.ray/auth_token here"
        raise ConnectionError(f"the Ray cluster at --ray-address {said} refused this client: {why}") from None
    except Exception:  # anything else is ray.init's to say
        return


def _speaks_grpc(sock) -> bool:
    """Whether the server answers as an HTTP/2 (gRPC) one does, with a SETTINGS frame: a Ray head's GCS and Ray
    Client's server do; a dashboard (HTTP/1.1), another service or a silent port does not."""
    header = b""
    try:
        sock.sendall(HTTP2_PREFACE)
        while len(header) < 9:  # a frame's header: length (3 bytes), type (1), flags (1), stream (4)
            chunk = sock.recv(9 - len(header))
            if not chunk:
                break
            header += chunk
    except OSError:  # no answer within PROBE_TIMEOUT_S, or the connection reset
        return False
    return len(header) == 9 and header[3] == 0x4


def _cpu_nodes(ray):
    return [node for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) >= 1]


def ray_shards(spec: ModelSpec, address: str = LOCAL, count: int | None = None, *, device: str | None = None,
               engine: str | None = None, options=None, progress=True, start_timeout_s=600) -> list[RayShard]:
    """Started Ray actor shards. device: "cuda" (an actor per GPU, `count` defaulting to every GPU of the
    cluster), "cpu" (CPU actors, `count` defaulting to one per node, placed round-robin over the nodes), or None:
    cuda when the cluster has GPUs, else cpu. engine: "fast" or "reference" (None: fast on GPUs, reference on
    CPUs); options: make_engine's."""
    if spec.weights is not None:  # a relative path is this folder's, not an actor's (its node's Ray's)
        spec = dataclasses.replace(spec, weights=os.path.abspath(spec.weights))
    connection = connect(address)
    ray = connection.ray
    try:
        return _start(connection, spec, address, count, device, engine, options or {}, progress, start_timeout_s)
    except BaseException:
        if connection.open_shards == 0 and connection.owned:
            ray.shutdown()
        raise


def shard_count(device: str, count: int | None, gpus: int, nodes: int, address: str) -> int:
    """The shards to start: `count`, or by default one per GPU (device cuda) or one per node (device cpu); a
    one-line error where the cluster cannot hold them."""
    if device not in ("cuda", "cpu"):  # cuda:N too: each actor steps on the GPU Ray gives it
        raise ValueError(f"--device {device}: Ray shards run on cuda (each on the GPU Ray gives it) or cpu")
    if device == "cuda":
        if gpus == 0:
            raise ValueError(f"--device {device}: the Ray cluster at {address} has no GPU; use --device cpu")
        if (count or gpus) > gpus:
            raise ValueError(f"--shards {count}: the Ray cluster at {address} has {gpus} GPU(s), one shard each")
        return count or gpus
    if nodes == 0:
        raise ValueError(f"the Ray cluster at {address} has no node with a free CPU")
    return count or nodes


def _free_per_node(ray) -> dict | None:
    """Each node's free resources by node id; None where Ray cannot say them here (a Ray Client's driver)."""
    try:
        return ray._private.state.available_resources_per_node()
    except Exception:
        return None


def _wait_free(ray, placements, address):
    """Refuse in one line, within FREE_WAIT_S, shards the cluster has not the free CPUs or GPUs for (another
    client's shards hold them): their actors waited, unsaid, for the start timeout (ten minutes by default)."""
    need = {name: sum(placement.get(key, 0) for placement in placements)
            for name, key in (("CPU", "num_cpus"), ("GPU", "num_gpus"))}
    on_node = {}  # a CPU shard is pinned to its node: the CPUs free on the others are not its
    for placement in placements:
        if "scheduling_strategy" in placement:
            node = placement["scheduling_strategy"].node_id
            on_node[node] = on_node.get(node, 0) + placement["num_cpus"]
    deadline = time.monotonic() + FREE_WAIT_S  # what a client that has just stopped held is freed in a moment
    while True:
        free = ray.available_resources()
        short = [name for name, count in need.items() if count and free.get(name, 0) < count - 1e-6]
        by_node = (_free_per_node(ray) if on_node and not short else None) or {}  # the cluster's shortage says it
        short_nodes = [node for node, cpus in on_node.items()
                       if node in by_node and by_node[node].get("CPU", 0) < cpus - 1e-6]
        if not short and not short_nodes:
            return
        if time.monotonic() >= deadline:
            total = ray.cluster_resources()
            held = [f"{free.get(name, 0):g} of {total.get(name, 0):g} {name}(s) free, {need[name]:g} needed"
                    for name in short]
            held += [f"node {node[:8]} has {by_node[node].get('CPU', 0):g} CPU(s) free, {on_node[node]:g} needed"
                     for node in short_nodes]
            raise ShardStartError(f"the Ray cluster at {address} cannot hold {len(placements)} shard(s) now: "
                                  f"{', '.join(held)} (another client's shards hold theirs until it exits; "
                                  f"`ray status` shows what is used)")
        time.sleep(0.25)


def _start(connection, spec, address, count, device, engine, options, progress, start_timeout_s):
    ray = connection.ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    gpus = int(ray.cluster_resources().get("GPU", 0))
    nodes = _cpu_nodes(ray)
    chosen = device is None
    device = device or ("cuda" if gpus else "cpu")
    given = count
    count = shard_count(device, count, gpus, len(nodes), address)
    if progress:
        why = [] if given else ["one per GPU" if device.startswith("cuda") else "one per node"]
        why += [f"--device not given: the cluster has {'GPUs' if gpus else 'no GPU'}"] if chosen else []
        sys.stderr.write(f"[sharded engine] the Ray cluster at {address} has {len(nodes)} node(s) and {gpus} GPU(s): "
                         f"{count} shard(s) on {'GPUs' if device.startswith('cuda') else 'CPUs'}"
                         + (f" ({', '.join(why)})" if why else "") + "\n")
    if device.startswith("cuda"):
        placements = [{"num_gpus": 1, "num_cpus": 1}] * count
        actor_device = "cuda"  # Ray gives each actor its GPU as CUDA_VISIBLE_DEVICES
    else:
        # Each CPU shard takes its share of its node's CPUs (its torch threads), a fraction where shards outnumber them,
        # on the nodes whose CPUs no other client holds first.
        free = _free_per_node(ray) or {}
        held = {node["NodeID"]: node["Resources"]["CPU"] - free.get(node["NodeID"], node["Resources"]).get("CPU", 0)
                for node in nodes}
        nodes.sort(key=lambda node: held[node["NodeID"]])
        on_node = [nodes[i % len(nodes)] for i in range(count)]
        placements = []
        for node in on_node:
            cpus, sharing = int(node["Resources"]["CPU"]), sum(other is node for other in on_node)
            placements.append({"num_cpus": cpus // sharing if cpus >= sharing else cpus / sharing,
                               "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)})
        actor_device = "cpu"
    engine = engine or ("fast" if actor_device == "cuda" else "reference")
    _wait_free(ray, placements, address)
    actor_class = ray.remote(ShardActor)
    shards = []
    for index, placement in enumerate(placements):
        shard = RayShard(index, actor_class.options(max_restarts=0, **placement).remote(), connection)
        connection.open_shards += 1
        shards.append(shard)
    starts = [shard.actor.start.remote(spec, actor_device, engine, options) for shard in shards]
    deadline = time.monotonic() + start_timeout_s

    def wait(shard):
        try:
            shard.ready(ray.get(starts[shard.index], timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.GetTimeoutError:
            raise ShardStartError(f"shard {shard.index} did not start within {start_timeout_s:.0f} s on the Ray "
                                  f"cluster at {address} (is a {'GPU' if actor_device == 'cuda' else 'CPU'} "
                                  f"free there? `ray status` shows what is used)") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise ShardStartError(f"shard {shard.index} failed to start on the Ray cluster at {address}: "
                                  f"{type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayActorError as exc:
            raise ShardStartError(f"shard {shard.index} failed to start on the Ray cluster at {address}: "
                                  f"{_reason(exc)}") from None
    return wait_started(shards, wait, progress)
