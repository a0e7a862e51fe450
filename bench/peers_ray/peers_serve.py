"""The driver of one Ray Serve server of bench/peers.py: ``python peers_serve.py CONFIG``.

CONFIG (JSON, written by ``bench/peer_ray.py``): ``port``, ``temp_dir``, ``cpus`` (the Ray
node's logical CPUs), ``replicas``, ``replica_cpus`` (each replica's ``num_cpus``),
``loaded`` and ``models`` (name -> {"path", "relu"}).

It starts a Ray head in this process (GCS, raylet; dashboard off), Serve's HTTP proxy on
127.0.0.1:port and the ``PeersModels`` application, then blocks (``serve.run(blocking=True)``).
Ray starts its head processes in this process' group and ties them to it (they die with it);
its workers (replicas, Serve's controller and proxy) are the raylet's children, each in a
group of its own: ``RayServer.stop`` kills the whole tree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from peers_deployment import PeersModels
from ray import serve


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    ray.init(
        num_cpus=config["cpus"],
        include_dashboard=False,
        _temp_dir=config["temp_dir"],
    )
    serve.start(http_options={"host": "127.0.0.1", "port": config["port"]})
    app = PeersModels.options(
        num_replicas=config["replicas"],
        ray_actor_options={"num_cpus": config["replica_cpus"]},
    ).bind(config["models"], config["loaded"])
    serve.run(app, name="peers", route_prefix="/", blocking=True)


if __name__ == "__main__":
    main()
