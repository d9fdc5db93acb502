"""Driver of tests/test_fleet_nodes.py (not a test): a Ray cluster of two simulated nodes, run under ``.venv-rollout``.

``ray.cluster_utils.Cluster``: a head node with no GPUs (where the fleet driver connects) and two worker nodes
``a`` and ``b`` with ``argv[1]`` logical GPUs each, all on this machine. Prints one JSON line {"address", "nodes":
{name: node id}}, then reads commands from stdin: ``kill NAME`` removes that node at once (its raylet is killed,
no graceful drain) and prints {"killed": NAME}; end of input shuts the cluster down.
"""

from __future__ import annotations

import json
import os
import sys

from ray.cluster_utils import Cluster

OBJECT_STORE_BYTES = 80 * 1024**2  # requests and answers are small; Ray's default takes 30% of RAM per node
# The GCS pings each raylet every period and declares the node dead after 5 failed pings in a row: a killed raylet
# fails each ping at once (connection refused), so that is 5 periods after the kill (Ray's 3 s default: ~15 s the
# test waits). A live raylet still has 5 x Ray's 10 s ping timeout to answer on loaded cores.
HEALTH_CHECK_PERIOD_MS = 1000


def main() -> None:
    os.environ.setdefault("RAY_worker_niceness", "0")  # the raylets' workers (the engines) at the driver's niceness
    gpus = int(sys.argv[1])
    head = {"num_cpus": 1, "num_gpus": 0, "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": {"health_check_period_ms": HEALTH_CHECK_PERIOD_MS}}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = {name: cluster.add_node(num_cpus=1, num_gpus=gpus, object_store_memory=OBJECT_STORE_BYTES) for name in "ab"}
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "nodes": {k: n.node_id for k, n in nodes.items()}}), flush=True)
    try:
        for line in sys.stdin:
            cmd, _, name = line.strip().partition(" ")
            if cmd == "kill":
                cluster.remove_node(nodes.pop(name), allow_graceful=False)
                print(json.dumps({"killed": name}), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
