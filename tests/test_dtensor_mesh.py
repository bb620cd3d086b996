"""DTensors on a real two-rank gloo mesh (two processes): each rank declares the piece it
holds (its offset, not 0) and digests its own local shard (not the full tensor)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cohortgate.agent.digest import tensor_digest
from tests.helpers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import cohortgate
    from cohortgate.agent.digest import weight_digests

    rank = int(sys.argv[1])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    w, b = torch.randn(4, 8), torch.randn(8)
    net = nn.Module()
    net.w = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    net.b = nn.Parameter(distribute_tensor(b, mesh, [Replicate()]))
    pieces = {
        p.tensor: [list(p.offset), list(p.length), p.replicated]
        for p in cohortgate.dtensor_pieces(net)
    }
    digests = {name: d.hex() for name, d in weight_digests(net)}
    dist.destroy_process_group()
    print(json.dumps({"pieces": pieces, "digests": digests}))
    """
)


def test_each_rank_of_a_two_rank_mesh_declares_and_digests_its_own_shard(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    torch.manual_seed(0)
    w, b = torch.randn(4, 8), torch.randn(8)
    for rank, got in enumerate(outs):
        assert got["pieces"]["w"] == [[2 * rank, 0], [2, 8], False], got["pieces"]
        assert got["pieces"]["b"] == [[0], [8], True]
        assert got["digests"]["w"] == tensor_digest("w", w[2 * rank : 2 * rank + 2]).hex()
        assert got["digests"]["b"] == tensor_digest("b", b).hex()
    assert outs[0]["digests"]["w"] != outs[1]["digests"]["w"]
